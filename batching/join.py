"""A request's one Redis round trip into its lane's open batch: a MULTI of plain commands (a
Lua call costs a Redis core several times more), SET NX GET of the open pointer (the batch
joined, or this request's new one), RPUSH of the item, now and then HGET of the admission
figure, and the INCR of a caller's counter (AppendCounter: a key's request count, for its rate
limit, which this module does not know). Sent by hand on a pooled connection: of the server,
or on a cluster of the master its slot's table names (again on the new one after a MOVED).
A request of several items, one the response cache may answer, or one near its key's request
limit joins by one script call instead (`join_items`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis
from redis.cluster import RedisCluster
from redis.exceptions import MaxConnectionsError, MovedError

from batching.keys import LaneKeys, ShardKeys


@dataclass(frozen=True)
class AppendCounter:
    """A counter of the caller's that the append raises (INCR) in its one round trip, and
    whose new value it returns: the request path counts a key's requests for its rate limit
    (accounts.ratelimit) at no extra Redis call. `expire_ms` also sets its expiry."""

    key: str
    expire_ms: int = 0


def join(
    client: redis.Redis,
    cluster: bool,
    keys: LaneKeys,
    pointer: str,
    item: str,
    ttl_ms: int,
    read_admission: bool,
    counter: AppendCounter | None,
) -> list[Any]:
    """The append's MULTI: [the open pointer before (None: `pointer` set), the pending
    list's length, (the admission figure), (the rate counter after its raise)]."""
    commands = _commands(keys, pointer, item, ttl_ms, read_admission, counter)
    if cluster:
        replies = _join_on_node(cast(RedisCluster, client), keys.open_batch, commands)
    else:
        replies = _send_packed(client.connection_pool, commands)
    return replies[:-1] if counter is not None and counter.expire_ms else replies  # PEXPIRE


def _commands(
    keys: LaneKeys,
    pointer: str,
    item: str,
    ttl_ms: int,
    read_admission: bool,
    counter: AppendCounter | None,
) -> list[tuple[str | int, ...]]:
    commands: list[tuple[str | int, ...]] = [
        ("MULTI",),
        ("SET", keys.open_batch, pointer, "NX", "GET", "PX", ttl_ms),
        ("RPUSH", keys.pending, item),
    ]
    if read_admission:
        commands.append(("HGET", keys.admission, keys.predicted))
    if counter is not None:
        commands.append(("INCR", counter.key))
        if counter.expire_ms:
            commands.append(("PEXPIRE", counter.key, counter.expire_ms))
    commands.append(("EXEC",))
    return commands


def _join_on_node(
    client: RedisCluster, key: str, commands: list[tuple[str | int, ...]]
) -> list[Any]:
    """The MULTI on the master the client's slot table names for `key`'s slot: redis-py's
    cluster pipeline spends about as much Python on it as the rest of the request. A master
    that no longer serves the slot answers MOVED to the first command and EXEC aborts:
    nothing was applied, the table learns the slot's new master as redis-py's own commands
    teach it (`_learn`), and the MULTI is sent there, once. ASK (a slot being migrated), a
    master away and a pool with no free connection raise, as through the pipeline (a 503)."""
    try:
        return _send_packed(_pool_of(client, key), commands)
    except MovedError as moved:
        _learn(client, moved)
        return _send_packed(_pool_of(client, key), commands)
    except MaxConnectionsError:  # a busy pool (batching.topology.WaitingPool): no news
        raise
    except (redis.ConnectionError, redis.TimeoutError) as away:
        _learn(client, away)
        raise


def _pool_of(client: RedisCluster, key: str) -> redis.ConnectionPool:
    node = client.get_node_from_key(key)
    assert node.redis_connection is not None  # every node of the table has its client
    return node.redis_connection.connection_pool


def _learn(client: RedisCluster, error: Exception) -> None:
    """What redis-py's cluster client does on MOVED or a master away: the table read again
    from the cluster every `reinitialize_steps` such errors; in between, a moved slot's new
    master taken from the MOVED itself."""
    client.reinitialize_counter += 1
    steps = client.reinitialize_steps
    if steps and client.reinitialize_counter % steps == 0:
        client.nodes_manager.initialize()
        client.reinitialize_counter = 0
    elif isinstance(error, MovedError):
        client.nodes_manager.move_slot(error)


def _send_packed(pool: redis.ConnectionPool, commands: list[tuple[str | int, ...]]) -> list[Any]:
    """A MULTI ... EXEC sent by hand on a pooled connection: redis-py's Pipeline spends several
    times the Python on the same bytes (docs/benchmarks/redis-cost.md)."""
    # The pool hands out a connection Redis closed (restarted) only after reconnecting it.
    conn = pool.get_connection()
    try:
        conn.send_packed_command(conn.pack_commands(commands))
        for _ in range(len(commands) - 1):
            conn.read_response()  # +OK, then +QUEUED (an error raises)
        replies = conn.read_response()
    except BaseException:
        conn.disconnect()  # replies may be left unread on it
        raise
    finally:
        pool.release(conn)
    for reply in replies:
        if isinstance(reply, redis.ResponseError):
            raise reply
    return list(replies)


@dataclass(frozen=True)
class ItemsCall:
    """What `join_items` sends besides the items: the batches this request would open (id
    prefix, opening time, maximum size), the rate counter and its limit (0: none), and the
    caller's policy version (the response cache's check)."""

    id_prefix: str
    redis_ms: int
    max_size: int
    ttl_ms: int
    read_admission: bool
    counter: AppendCounter | None
    cost: int
    limit: int
    version: int
    clock: str = ""  # a set time (tests), or "" for the node's


def join_items(
    script: Any,
    shard: ShardKeys,
    keys: LaneKeys,
    call: ItemsCall,
    items: Sequence[tuple[str, str]],
    grace_ms: int,
) -> list[Any]:
    """Every item (digest, item) of a request appended, or answered from the response cache,
    by one call of the script `append_items` (batching/lua/append_items.lua): what it
    returns."""
    script_keys = [
        keys.open_batch, keys.pending, keys.unsealed, shard.handover_due, keys.admission,
        shard.sent, shard.lanes, shard.cache_version,
    ]  # fmt: skip
    counter = call.counter
    if counter is not None:
        script_keys.append(counter.key)
    args: list[str | int] = [
        call.id_prefix, call.redis_ms, call.max_size, call.ttl_ms,
        keys.predicted if call.read_admission else "", call.cost, call.limit,
        counter.expire_ms if counter else 0, call.version, shard.prefix, shard.batch_prefix,
        grace_ms, keys.lane, call.clock,
    ]  # fmt: skip
    for digest, item in items:
        args += [digest, item]
    return list(script(keys=script_keys, args=args))
