from __future__ import annotations

from django.apps import AppConfig


class SamplingConfig(AppConfig):
    name = "sampling"
