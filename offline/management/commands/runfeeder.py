"""`python manage.py runfeeder`: the offline jobs' feeder (offline.feeder.serve), a process of
its own at the lowest CPU priority, until SIGTERM. Run one or more per deployment: one at a
time feeds (a Redis lock), another takes over within LOCK_TTL_S of its death."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from offline import feeder


class Command(BaseCommand):
    help = "Feed offline jobs (the Batch API) to the GPUs' empty places, until SIGTERM."

    def handle(self, *args: Any, **options: Any) -> None:
        feeder.serve()
