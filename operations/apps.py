from __future__ import annotations

from django.apps import AppConfig

from batching.installed_names import OPERATIONS_APP_LABEL


class OperationsConfig(AppConfig):
    """The operators' side: the policy, its audit log, statistics, the stats page.

    Its label stays "sampling" (batching.installed_names says why).
    """

    name = "operations"
    label = OPERATIONS_APP_LABEL
    verbose_name = "Sampling"

    def ready(self) -> None:
        # The web processes' background loop runs the housekeeping every few seconds; the
        # request path (sampling) knows nothing of this app, so the app registers itself.
        from operations import canary, housekeeping
        from operations.models import republish_missing_access
        from serving.runtime import register_access_republisher, register_background_job

        register_background_job(housekeeping.run)
        register_background_job(canary.run)
        register_access_republisher(republish_missing_access)
