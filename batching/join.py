"""A request's one Redis round trip into its lane's open batch: a MULTI of plain commands (a
Lua call costs a Redis core several times more), SET NX GET of the open pointer (the batch
joined, or this request's new one), RPUSH of the item, now and then HGET of the admission
figure, and the INCR of a rate counter. Sent by hand on a pooled connection, or through a
cluster client's pipeline, which routes it to the shard's master. A request of several items,
one the response cache may answer, or one near its key's request limit joins by one script
call instead (`join_items`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from batching.keys import LaneKeys, ShardKeys
from batching.ratelimit import RateCounter


def join(
    client: redis.Redis,
    cluster: bool,
    keys: LaneKeys,
    pointer: str,
    item: str,
    ttl_ms: int,
    read_admission: bool,
    counter: RateCounter | None,
) -> list[Any]:
    """The append's MULTI: [the open pointer before (None: `pointer` set), the pending
    list's length, (the admission figure), (the rate counter after its raise)]."""
    send = _join_pipelined if cluster else _join_packed
    replies = send(client, keys, pointer, item, ttl_ms, read_admission, counter)
    return replies[:-1] if counter is not None and counter.expire_ms else replies  # PEXPIRE


def _join_pipelined(
    client: redis.Redis,
    keys: LaneKeys,
    pointer: str,
    item: str,
    ttl_ms: int,
    read_admission: bool,
    counter: RateCounter | None,
) -> list[Any]:
    with client.pipeline(transaction=True) as pipe:
        pipe.set(keys.open_batch, pointer, nx=True, get=True, px=ttl_ms)
        pipe.rpush(keys.pending, item)
        if read_admission:
            pipe.hget(keys.admission, keys.predicted)
        if counter is not None:
            pipe.incr(counter.key)
            if counter.expire_ms:
                pipe.pexpire(counter.key, counter.expire_ms)
        return list(pipe.execute())


def _join_packed(
    client: redis.Redis,
    keys: LaneKeys,
    pointer: str,
    item: str,
    ttl_ms: int,
    read_admission: bool,
    counter: RateCounter | None,
) -> list[Any]:
    """`_join_pipelined`'s bytes, sent by hand on a pooled connection: redis-py's Pipeline
    spends several times the Python on them (`python -m bench.append_cost`)."""
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
    pool = client.connection_pool
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
    counter: RateCounter | None
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
