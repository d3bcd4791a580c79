from __future__ import annotations

from django.apps import AppConfig


class OfflineConfig(AppConfig):
    """Offline jobs: OpenAI's Batch API (files and batches), fed to the GPUs' empty places
    through the backfill lane (batching.backfill)."""

    name = "offline"
    verbose_name = "Offline jobs"

    def ready(self) -> None:
        # The feeder is a process of its own: `python manage.py runfeeder` (offline.feeder).
        from offline import openapi
        from serving.openapi import DocumentPart, register_part

        register_part(DocumentPart(openapi.paths, openapi.VALIDATED, openapi.SERIALIZED))
