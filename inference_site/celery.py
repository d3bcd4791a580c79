"""The Celery app's entry point (`celery -A inference_site`): the app itself lives with the
request path, its main user (sampling.broker)."""

from __future__ import annotations

from sampling.broker import app

__all__ = ("app",)
