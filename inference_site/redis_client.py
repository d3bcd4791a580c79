"""The Redis client of a web process: the one home of the connection that the request path
(sampling) and the operators' app (operations) share.

Beside the Celery app (inference_site.celery) because it is the same kind of thing: a
connection of the Django project, built from its settings (SAMPLING_REDIS_URL,
SAMPLING_REDIS_CLUSTER) once per process after gunicorn forks. Neither app owns it, so
neither imports the other's runtime for it: an admin save that publishes a policy and a
request that joins a batch use the same bounded pool. The GPU workers build their own from
their own settings (workers.lifecycle).

The pool is bounded: thousands of waiting requests share a few dozen connections, since a
request holds one only for its single round trip.
"""

from __future__ import annotations

import os

import redis
from django.conf import settings

from batching import topology

MAX_CONNECTIONS_PER_PROCESS = 64

_clients: dict[int, redis.Redis] = {}


def redis_client() -> redis.Redis:
    """This process's client of the request path's Redis (SAMPLING_REDIS_URL), over a bounded
    pool (per master on a cluster)."""
    pid = os.getpid()
    client = _clients.get(pid)
    if client is None:
        client = _clients[pid] = _connect()
    return client


def _connect() -> redis.Redis:
    options = {"socket_timeout": 5, "socket_connect_timeout": 2}
    if settings.SAMPLING_REDIS_CLUSTER:
        return topology.redis_client(
            settings.SAMPLING_REDIS_URL,
            cluster=True,
            max_connections=MAX_CONNECTIONS_PER_PROCESS,
            **{**options, "socket_connect_timeout": 0.5},
        )
    pool = redis.BlockingConnectionPool.from_url(
        settings.SAMPLING_REDIS_URL,
        max_connections=MAX_CONNECTIONS_PER_PROCESS,
        timeout=2,
        **options,
    )
    return redis.Redis(connection_pool=pool)


def forget_clients() -> None:
    """Drop this process's client (tests that change the settings between cases)."""
    _clients.clear()
