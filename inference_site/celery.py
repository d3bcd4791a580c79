"""The Celery app's entry point (`celery -A inference_site`): the app itself lives with the
request path, its main user (serving.broker)."""

from __future__ import annotations

from serving.broker import app

__all__ = ("app",)
