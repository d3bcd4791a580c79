from __future__ import annotations

from django.urls import path, re_path

from serving import api, embeddings, views

urlpatterns = [
    path("sample", views.sample, name="sample"),
    path("healthz", views.healthz, name="healthz"),
    path("readyz", views.readyz, name="readyz"),
    path("metrics", views.metrics_view, name="metrics"),
    path("v1/completions", api.completions, name="v1-completions"),
    path("v1/chat/completions", api.chat_completions, name="v1-chat-completions"),
    path("v1/embeddings", embeddings.embeddings, name="v1-embeddings"),
    path("v1/models", api.models, name="v1-models"),
    path("v1/openapi.json", api.openapi, name="v1-openapi"),
    # Any id, even one with a newline: an unknown model gets the API's 404, not Django's page.
    re_path(r"^v1/models/(?P<model_id>[\s\S]+)$", api.model, name="v1-model"),
    re_path(r"^v1/", api.not_found, name="v1-not-found"),
    path("api/inference", api.inference, name="api-inference"),
]
