"""Where the request path's Redis lives: one server, or a Redis/Valkey cluster.

SAMPLING_REDIS_URL names a server, or a seed node of a cluster when SAMPLING_REDIS_CLUSTER is
on; every process builds its clients here. A cluster client offers the same commands (and
Lua scripts, routed by their keys' slot) as a plain one, so the rest of the project types it
as `redis.Redis`. Django-free: settings pass plain values.
"""

from __future__ import annotations

from typing import Any, cast

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import MaxConnectionsError, RedisClusterException
from redis.retry import Retry

# A cluster client gives up on a dead master at once (the node's shards answer 503), instead
# of retrying with back-off for seconds while requests wait: the other masters keep serving.
CLUSTER_OPTIONS: dict[str, Any] = {
    "socket_connect_timeout": 0.5,
    "retry": Retry(NoBackoff(), retries=0),
}

# What a Redis call raises when Redis does not answer: a RedisError, or on a cluster a
# RedisClusterException (not a RedisError: "Redis Cluster cannot be connected", a slot not
# covered) when no master answers. Whoever turns an unreachable Redis into a 503 (or a loop's
# "runs again") catches these.
REDIS_FAULTS: tuple[type[Exception], ...] = (redis.RedisError, RedisClusterException)


# What redis-py's BlockingConnectionPool raises when no connection came free within its wait.
_NONE_CAME_FREE = "No connection available."


class WaitingPool(redis.BlockingConnectionPool):
    """A bounded pool that waits for a free connection (up to its `timeout`), and when none
    came free raises MaxConnectionsError, not the plain ConnectionError of redis-py's
    BlockingConnectionPool. A busy pool is no news of the cluster's layout: redis-py's
    cluster client takes a ConnectionError for a master away, reads the layout again and drops
    every free connection of the pool (more work for a process already too busy), and takes
    MaxConnectionsError (a ConnectionError too: a 503 all the same) for what it is."""

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().get_connection(*args, **kwargs)
        except redis.ConnectionError as exc:
            if type(exc) is redis.ConnectionError and str(exc) == _NONE_CAME_FREE:
                raise MaxConnectionsError(f"{_NONE_CAME_FREE} (waited {self.timeout} s)") from exc
            raise


def redis_client(url: str, cluster: bool = False, **options: Any) -> redis.Redis:
    """A client of the server at `url`, or of the cluster `url` is a node of."""
    if cluster:
        return cast(redis.Redis, RedisCluster.from_url(url, **{**CLUSTER_OPTIONS, **options}))
    return redis.Redis.from_url(url, **options)


def is_cluster(client: object) -> bool:
    return isinstance(client, RedisCluster)
