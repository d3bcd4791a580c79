"""Keyed traffic, Redis restarted with an empty data set (the issue's done-when): no valid key
gets a 401 at any moment, nor is served as anonymous while keys are optional (every 200
carries the key's own limit); the requests in flight at the restart get a 503 or a 504, and
every request sent from 2 s after the restart gets its completion. The web processes
keep their last good key set while Redis has none, and the first to notice republishes it
from the database at once (accounts.access, operations.models.republish_missing_access)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import redis

from accounts import access
from devstack.embedded_redis import EmbeddedRedis
from devstack.stack import Stack
from tests.support.http import sample
from tests.support.keys import bearer, create_key
from tests.support.waiting import wait_until
from workers.samplers.simulated import expected_completion

pytestmark = pytest.mark.integration

RATE_RPS = 40  # open loop: requests are sent at this pace whatever the answers
RECOVERY_S = 2.0  # from the restart, every request gets its completion
# The set is back in Redis this soon after the restart: a poll of a key watcher (0.5 s) and
# a publish, not housekeeping's next run (every 10 s).
REPUBLISHED_WITHIN_S = 1.5
# The keys' own limit, far above the load: what tells a request served as the key's (its
# x-ratelimit-limit-requests header) from one served as anonymous (no limit, no header).
KEY_RPM = "1000000"


@dataclass(frozen=True)
class Answer:
    sent_at: float  # monotonic
    status: int
    right: bool  # a 200 with its own completion
    body: str
    rpm: str | None  # the limit the answer says the caller has


@pytest.fixture
def own_redis() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis().start()
    yield server
    server.stop()


def served_as_itself(stack: Stack, key: str) -> bool:
    """8 requests in a row (spread over the web processes) served with the key's own limit."""
    return all(
        sample(stack.base_url, "known?", headers=bearer(key)).headers.get(
            "x-ratelimit-limit-requests"
        )
        == KEY_RPM
        for _ in range(8)
    )


def keyed_load(
    base_url: str, keys: list[str], stop: threading.Event, answers: list[Answer]
) -> None:
    def one(index: int) -> None:
        prompt = f"restart {index}"
        sent = time.monotonic()
        rpm = None
        try:
            reply = sample(base_url, prompt, headers=bearer(keys[index % len(keys)]), timeout=5)
            status, body = reply.status, reply.body
            rpm = reply.headers.get("x-ratelimit-limit-requests")
        except OSError:
            status, body = 0, ""
        right = status == 200 and body == expected_completion(prompt)
        answers.append(Answer(sent, status, right, body[:200], rpm))

    with ThreadPoolExecutor(64) as pool:
        index = 0
        next_at = time.monotonic()
        while not stop.is_set():
            pool.submit(one, index)
            index += 1
            next_at += 1 / RATE_RPS
            time.sleep(max(0.0, next_at - time.monotonic()))  # duration: the load's pace


def intact(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_timeout=1)
    try:
        return access.intact(client)
    finally:
        client.close()


@pytest.mark.parametrize("required", ["1", "0"], ids=["keys-required", "keys-optional"])
def test_valid_keys_hold_across_a_redis_restart_with_no_data(
    required: str, own_redis: EmbeddedRedis, start_stack: Callable[..., Stack]
) -> None:
    stack = start_stack(
        "keys-restart",
        env={
            "REDIS_URL": own_redis.url,
            "SAMPLER": "simulated",
            "SIMULATED_BATCH_MS": "50",
            "SAMPLING_DEADLINE_MS": "1000",
            "SAMPLING_REQUIRE_API_KEY": required,
        },
        gpus=[0],
        web_processes=2,
    )
    keys = [
        create_key(stack, f"restart {tier}", "--tier", tier, "--rpm", KEY_RPM)
        for tier in ("plus", "free")
    ]
    # The load starts once every web process knows both keys (they poll every 0.5 s): with
    # keys optional an unknown key is served too, as anonymous, so it is the key's own limit
    # on the answers that says so.
    wait_until(lambda: all(served_as_itself(stack, key) for key in keys), 5, "keys known")
    answers: list[Answer] = []
    stop = threading.Event()
    load = threading.Thread(target=keyed_load, args=(stack.base_url, keys, stop, answers))
    load.start()
    try:
        wait_until(lambda: sum(a.right for a in list(answers)) >= 2 * RATE_RPS, 20, "served")
        killed_at = time.monotonic()
        own_redis.kill()
        own_redis.start()  # empty: no RDB, no AOF; returns once it answers
        back_at = time.monotonic()
        wait_until(lambda: intact(own_redis.url), REPUBLISHED_WITHIN_S, "keys republished")
        wait_until(
            lambda: sum(a.sent_at >= back_at + RECOVERY_S for a in list(answers)) >= 5 * RATE_RPS,
            RECOVERY_S + 20,
            "5 s of requests answered after the recovery",
        )
    finally:
        stop.set()
        load.join(timeout=30)

    unauthorized = [a for a in answers if a.status == 401]
    assert not unauthorized, f"{len(unauthorized)} 401s for valid keys: {unauthorized[:3]}"
    anonymous = [a for a in answers if a.status == 200 and a.rpm != KEY_RPM]
    assert not anonymous, f"{len(anonymous)} served without the key's tier: {anonymous[:3]}"
    before = [a for a in answers if a.sent_at < killed_at - 1.0]
    around = [a for a in answers if killed_at - 1.0 <= a.sent_at < back_at + RECOVERY_S]
    after = [a for a in answers if a.sent_at >= back_at + RECOVERY_S]
    assert before
    assert after
    assert all(a.right for a in before)
    # In flight at the restart (their batch lost with Redis's data): a 503 or a 504.
    failed = [a for a in around if not a.right]
    assert all(a.status in (503, 504) for a in failed), failed[:5]
    wrong = [a for a in after if not a.right]
    assert not wrong, f"{len(wrong)} of {len(after)} after recovery: {wrong[:5]}"
    assert stack.web is not None
    assert stack.web.poll() is None
