from __future__ import annotations

from django.apps import AppConfig


class OfflineConfig(AppConfig):
    """Offline jobs: OpenAI's Batch API (files and batches), fed to the GPUs' empty places
    through the backfill lane (batching.backfill)."""

    name = "offline"
    verbose_name = "Offline jobs"

    def ready(self) -> None:
        # The feeder runs in a loop of each web process (one at a time feeds: a Redis lock).
        from offline import feeder
        from sampling.runtime import register_process_loop

        register_process_loop("offline-feeder", feeder.run, feeder.FEED_INTERVAL_S)
