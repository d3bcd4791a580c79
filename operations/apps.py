from __future__ import annotations

from django.apps import AppConfig


class OperationsConfig(AppConfig):
    """The operators' side: the policy, its audit log, statistics, the stats page.

    Its label stays "sampling", the app's name before the split into rooms: the database
    tables (sampling_*), migration history, content types, permissions and admin URLs
    (/admin/sampling/...) of existing installations are this app's, unchanged.
    """

    name = "operations"
    label = "sampling"
    verbose_name = "Sampling"

    def ready(self) -> None:
        # The web processes' background loop runs the housekeeping every few seconds; the
        # request path (sampling) knows nothing of this app, so the app registers itself.
        from operations import canary, housekeeping
        from operations.models import republish_missing_access
        from sampling.runtime import register_access_republisher, register_background_job

        register_background_job(housekeeping.run)
        register_background_job(canary.run)
        register_access_republisher(republish_missing_access)
