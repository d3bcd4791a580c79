from __future__ import annotations

from django.urls import path

from sampling import views

urlpatterns = [
    path("sample", views.sample, name="sample"),
    path("healthz", views.healthz, name="healthz"),
    path("readyz", views.readyz, name="readyz"),
    path("metrics", views.metrics_view, name="metrics"),
]
