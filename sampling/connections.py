"""The per-process Redis client and aggregator of a web process.

Built lazily after gunicorn forks (and after gevent patches sockets), once per process.
The pool is bounded: thousands of waiting requests share a few dozen connections, since a
request holds one only for its single Lua call.
"""

from __future__ import annotations

import logging
import os

import redis
from django.conf import settings

from sampling.aggregator import BatchAggregator

log = logging.getLogger(__name__)

MAX_CONNECTIONS_PER_PROCESS = 64

_by_pid: dict[int, BatchAggregator] = {}


def aggregator() -> BatchAggregator:
    pid = os.getpid()
    found = _by_pid.get(pid)
    if found is None:
        pool = redis.BlockingConnectionPool.from_url(
            settings.REDIS_URL,
            max_connections=MAX_CONNECTIONS_PER_PROCESS,
            timeout=2,
            socket_timeout=5,
            socket_connect_timeout=2,
        )
        found = _by_pid[pid] = BatchAggregator(
            redis.Redis(connection_pool=pool),
            settings.SAMPLING_QUEUE,
            max_batch_size=settings.SAMPLING_MAX_BATCH_SIZE,
            deadline_ms=settings.SAMPLING_DEADLINE_MS,
        )
    return found


def warm_up() -> None:
    """Pay at process start what the first requests would otherwise pay inside their deadline
    (measured: the first /sample of a fresh process took ~30 ms longer than the next): the
    view's imports, a Redis connection with the Lua scripts loaded, the broker connection of
    Celery's producer, and the result listener's subscription connection. Called by
    gunicorn's post_worker_init; a failure is only logged, the requests will retry."""
    from django.urls import resolve
    from kombu.common import maybe_declare

    from inference_site.celery import app as celery_app

    resolve("/sample")  # imports the view, the Celery task and the result backend
    try:
        aggregator().load_scripts()
        with celery_app.producer_pool.acquire(block=True, timeout=2) as producer:
            producer.connection.ensure_connection(max_retries=1)
            # The first publish to a queue declares it on that connection: do it now.
            queue = celery_app.amqp.queues[settings.SAMPLING_QUEUE]
            maybe_declare(queue, producer.channel)
        celery_app.backend.listener.ensure_started()
    except Exception as exc:  # Redis down at start: the requests will say so (503)
        log.warning("web process warm-up incomplete: %s", exc)
