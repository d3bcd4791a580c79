from __future__ import annotations

from django.apps import AppConfig


class PlanningConfig(AppConfig):
    """The capacity planner: `python manage.py capacity` (a simulation; no models)."""

    name = "planning"
