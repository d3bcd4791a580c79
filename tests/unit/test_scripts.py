"""The Lua scripts of batching/lua/ as the loader gives them to Redis: whole, and loadable."""

from __future__ import annotations

import re

import pytest
import redis

from batching import scripts
from batching.keys import QueueKeys
from batching.lanes import SCRIPT_CONSTANTS
from batching.registry import HEARTBEAT_TIMEOUT_MS, WorkerRegistry
from tests.support import unique_queue
from tests.support.clocks import redis_ms
from tests.support.waiting import wait_until

SCRIPT_NAMES = sorted(path.stem for path in scripts.LUA_DIR.glob("*.lua") if path.stem != "common")


def test_every_script_is_known() -> None:
    assert SCRIPT_NAMES == [
        "admission", "advance_persisted", "answer_backfill", "append_items", "claim_name",
        "clear_dirty", "clock", "close", "flush_stats", "heartbeat", "hold_spend", "jobs_held",
        "publish", "release_spend", "reserve_tokens", "return_backfill", "seal",
        "settle_tokens", "take_due", "take_feeder_lock", "trim_done", "withdraw",
    ]  # fmt: skip


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_a_script_has_no_marker_left_and_loads_in_redis(
    name: str, redis_client: redis.Redis
) -> None:
    text = scripts.source(name, SCRIPT_CONSTANTS)
    assert "{{" not in text
    assert "}}" not in text
    assert not re.search(r"^-- #include", text, re.MULTILINE)
    assert re.search(r"^-- KEYS\[1\]", (scripts.LUA_DIR / f"{name}.lua").read_text(), re.MULTILINE)
    sha = redis_client.script_load(text)
    assert redis_client.script_exists(sha) == [True]


def test_a_constant_without_a_value_is_an_error_when_loading() -> None:
    with pytest.raises(ValueError, match=r"seal\.lua: no value for"):
        scripts.source("seal", {})


def test_the_constants_come_from_python() -> None:
    text = scripts.source("seal", SCRIPT_CONSTANTS)
    assert f"hold * {SCRIPT_CONSTANTS['HOLD_LATE_FACTOR']} or hold" in text
    assert f"or {SCRIPT_CONSTANTS['MAX_BATCH_SIZE']}\n" in text


def test_a_script_reads_a_set_clock_or_the_node_s(redis_client: redis.Redis) -> None:
    clock = scripts.register(redis_client, "clock")
    assert clock(keys=["k"], args=[1_234_567]) == [1234, 567_000]
    seconds, _ = clock(keys=["k"])
    assert abs(int(seconds) - redis_client.time()[0]) <= 1
    workers = WorkerRegistry(redis_client, QueueKeys(unique_queue("clock")))
    now = redis_ms(redis_client)
    assert workers.heartbeat("gpu0", now_ms=now - 4000) == 1
    assert workers.live_count() == 1  # the node's time: 4 s later, within the timeout
    assert workers.live_count(now_ms=now + 1001) == 0  # 5,001 ms after its heartbeat


def test_a_worker_name_is_claimed_by_one_process_at_a_time(redis_client: redis.Redis) -> None:
    workers = WorkerRegistry(redis_client, QueueKeys(unique_queue("claim")))
    owner = workers.keys.worker_owner("gpu0")
    assert workers.claim("gpu0", "a") is None
    assert workers.claim("gpu0", "b") == "a"  # a live one holds it
    assert workers.claim("gpu0", "a") is None  # renewed
    assert 0 < redis_client.pttl(owner) <= HEARTBEAT_TIMEOUT_MS
    workers.release("gpu0", "b")  # not its claim: kept
    assert workers.claim("gpu0", "b") == "a"
    workers.release("gpu0", "a")
    assert workers.claim("gpu0", "b") is None
    redis_client.pexpire(owner, 1)  # b died without releasing it: its claim expires
    wait_until(lambda: workers.claim("gpu0", "c") is None, 1, "the expired claim taken")
