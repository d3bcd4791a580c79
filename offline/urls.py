from __future__ import annotations

from django.urls import path

from offline import views

urlpatterns = [
    path("v1/files", views.files, name="v1-files"),
    path("v1/files/<str:file_id>", views.file, name="v1-file"),
    path("v1/files/<str:file_id>/content", views.file_content, name="v1-file-content"),
    path("v1/batches", views.batches, name="v1-batches"),
    path("v1/batches/<str:job_id>", views.batch, name="v1-batch"),
    path("v1/batches/<str:job_id>/cancel", views.cancel, name="v1-batch-cancel"),
]
