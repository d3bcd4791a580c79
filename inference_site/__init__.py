# Make sure the Celery app is loaded when Django starts so that @shared_task uses it.
from __future__ import annotations

from inference_site.celery import app as celery_app

__all__ = ("celery_app",)
