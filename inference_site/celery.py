from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inference_site.settings")

app = Celery("inference_site")

# All Celery settings live in Django's settings with the CELERY_ prefix.
app.config_from_object("django.conf:settings", namespace="CELERY")

# Load task modules (workers/tasks.py) from all registered Django apps.
app.autodiscover_tasks()
