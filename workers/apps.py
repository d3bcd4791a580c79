from __future__ import annotations

from django.apps import AppConfig


class WorkersConfig(AppConfig):
    name = "workers"

    def ready(self) -> None:
        # Connect the worker signals (they only fire inside `celery worker`).
        from workers import lifecycle  # noqa: F401
