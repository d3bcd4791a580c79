"""The product's settings plus the baselines' URLs and tasks: the benchmark's web and worker
processes of the baselines run with DJANGO_SETTINGS_MODULE=bench.baselines.settings."""

from __future__ import annotations

from config.env import env_int
from inference_site.settings import *  # noqa: F403
from inference_site.settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "bench.baselines"]  # Celery finds bench/baselines/tasks.py
ROOT_URLCONF = "bench.baselines.urls"

# celery-batches flushes its buffer at BENCH_FLUSH_EVERY messages or every
# BENCH_FLUSH_INTERVAL_MS (a repeating timer); the web-process batcher BENCH_TIMER_MS after
# its buffer's first request or at BENCH_FLUSH_EVERY requests.
BENCH_FLUSH_EVERY = env_int("BENCH_FLUSH_EVERY", 100, minimum=1, maximum=100)
BENCH_FLUSH_INTERVAL_MS = env_int("BENCH_FLUSH_INTERVAL_MS", 100, minimum=1)
BENCH_TIMER_MS = env_int("BENCH_TIMER_MS", 250, minimum=1)
