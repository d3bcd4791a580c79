"""The Redis client of a web process: the one home of the connection that the request path
(sampling) and the operators' app (operations) share.

A connection of the Django project, built from its settings (SAMPLING_REDIS_URL,
SAMPLING_REDIS_CLUSTER) once per process after gunicorn forks. It lives with the request
path, its main user; the operators' app, a floor above, imports it and not the request
path's runtime: an admin save that publishes a policy and a request that joins a batch use
the same bounded pool. The GPU workers build their own from their own settings
(workers.lifecycle).

The pool is bounded: thousands of waiting requests share a few dozen connections, since a
request holds one only for its single round trip. A request that finds every connection
taken waits for one (up to POOL_WAIT_S, well within a deadline), on one server and on a
cluster alike (batching.topology.WaitingPool): redis-py's cluster client builds each master's
pool from `connection_pool_class`, so it gets the same waiting pool instead of its default
pool, which refuses at the limit at once (503s under a load one Redis serves).
"""

from __future__ import annotations

import os

import redis
from django.conf import settings

from batching import topology

MAX_CONNECTIONS_PER_PROCESS = 64  # per master on a cluster
POOL_WAIT_S = 2.0  # a request waits this long at most for a free connection of the pool

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
    return connect(settings.SAMPLING_REDIS_URL, settings.SAMPLING_REDIS_CLUSTER)


def connect(url: str, cluster: bool) -> redis.Redis:
    """A client of the server (or cluster) at `url` over bounded pools that wait for a free
    connection rather than refuse one."""
    options = {"socket_timeout": 5, "socket_connect_timeout": 2}
    if cluster:
        return topology.redis_client(
            url,
            cluster=True,
            max_connections=MAX_CONNECTIONS_PER_PROCESS,
            connection_pool_class=topology.WaitingPool,
            timeout=POOL_WAIT_S,
            **{**options, "socket_connect_timeout": 0.5},
        )
    pool = topology.WaitingPool.from_url(
        url, max_connections=MAX_CONNECTIONS_PER_PROCESS, timeout=POOL_WAIT_S, **options
    )
    return redis.Redis(connection_pool=pool)


def forget_clients() -> None:
    """Drop this process's client (tests that change the settings between cases)."""
    _clients.clear()
