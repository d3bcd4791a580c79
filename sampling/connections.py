"""The per-process Redis client and aggregator of a web process.

Built lazily after gunicorn forks (and after gevent patches sockets), once per process.
The pool is bounded: thousands of waiting requests share a few dozen connections, since a
request holds one only for its single Lua call.
"""

from __future__ import annotations

import os

import redis
from django.conf import settings

from sampling.aggregator import BatchAggregator

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
