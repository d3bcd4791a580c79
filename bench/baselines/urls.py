from __future__ import annotations

from django.urls import include, path

from bench.baselines import views

urlpatterns = [
    path("baseline/per-request", views.per_request, name="baseline-per-request"),
    path("baseline/celery-batches", views.celery_batches, name="baseline-celery-batches"),
    path("baseline/timer", views.timer, name="baseline-timer"),
    path("baseline/set", views.plain_set, name="baseline-set"),
    path("", include("inference_site.urls")),
]
