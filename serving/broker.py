"""The Django project's Celery app: the request path sends batch tasks and reads results
through it, and `celery -A inference_site worker` finds it through inference_site.celery."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inference_site.settings")

app = Celery("inference_site")

# All Celery settings live in Django's settings with the CELERY_ prefix.
app.config_from_object("django.conf:settings", namespace="CELERY")

# Task modules of the installed apps; the batch task (workers/tasks.py) is in CELERY_IMPORTS,
# which only `celery worker` imports.
app.autodiscover_tasks()
