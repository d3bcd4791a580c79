"""Priority tiers against real processes: a free GPU takes the highest tier's waiting batch
first, so an enterprise batch sent behind a backlog of free batches is sampled ahead of
them; the stats page shows each tier's requests."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
import redis

from accounts.access import STARTING_TIERS
from batching.aggregator import BatchAggregator
from batching.keys import LaneKeys
from batching.policy import Policy
from devstack.stack import Stack
from operations import dashboard
from operations.dashboard import TierRow
from telemetry.recommendation import RECENT_S
from tests.support import ADMIN_PASSWORD, ADMIN_USER
from tests.support.admin_client import AdminSession
from tests.support.http import sample
from tests.support.keys import bearer, create_key
from tests.support.queue_views import batch_log_of
from tests.support.waiting import wait_until
from workers.samplers.simulated import expected_completion

pytestmark = pytest.mark.integration

BATCH = 5
CALL_MS = 300
FREE_BATCHES = 5


@pytest.fixture(scope="module")
def tiered(start_stack: Callable[..., Stack]) -> Stack:
    return start_stack(
        "tiers",
        env={
            "SAMPLER": "simulated",
            "SIMULATED_BATCH_MS": str(CALL_MS),
            "SAMPLING_MAX_BATCH_SIZE": str(BATCH),
            # Long enough that the whole backlog is served: the order is what is measured.
            "SAMPLING_DEADLINE_MS": "10000",
            "SAMPLING_REQUIRE_API_KEY": "1",
        },
        web_processes=2,
    )


def works(stack: Stack, key: str) -> bool:
    return sample(stack.base_url, "x", headers=bearer(key)).status == 200


def test_a_higher_tier_is_served_ahead_of_a_lower_tiers_backlog(tiered: Stack) -> None:
    keys = {
        tier: create_key(tiered, f"tiers-{tier}", "--tier", tier) for tier in ("enterprise", "free")
    }
    for key in keys.values():
        wait_until(partial(works, tiered, key), 5)
    client = redis.Redis.from_url(tiered.env["REDIS_URL"])
    aggregator = BatchAggregator(client, tiered.env["SAMPLING_QUEUE"])
    free_lane = LaneKeys.of(aggregator.shards[0], STARTING_TIERS["free"])
    seen = {json.loads(raw)["batch_id"] for raw in batch_log_of(aggregator).recent()}

    def send(tier: str, index: int) -> tuple[str, int, str, float]:
        prompt = f"{tier} {index}"
        reply = sample(tiered.base_url, prompt, headers=bearer(keys[tier]), timeout=30)
        return prompt, reply.status, reply.body, time.monotonic()

    with ThreadPoolExecutor(max_workers=BATCH * (FREE_BATCHES + 1) + 4) as pool:
        free = [pool.submit(send, "free", i) for i in range(BATCH * FREE_BATCHES)]
        # The free backlog is in place (full batches waiting behind the running call) before
        # the enterprise requests come.
        wait_until(lambda: client.zcard(free_lane.unsealed) >= FREE_BATCHES - 2, 5)
        enterprise = [pool.submit(send, "enterprise", i) for i in range(BATCH)]
        answers = {
            "free": [f.result() for f in free],
            "enterprise": [f.result() for f in enterprise],
        }

    for tier, replies in answers.items():
        for prompt, status, body, _ in replies:
            assert (status, body) == (200, expected_completion(prompt)), tier
    # The enterprise batch went ahead of the free batches still waiting: at most the call
    # running when it came and the one its worker held ran before it.
    records = [json.loads(raw) for raw in reversed(batch_log_of(aggregator).recent())]
    order = [r["lane"] for r in records if r["batch_id"] not in seen and r["size"] == BATCH]
    assert order.count(STARTING_TIERS["enterprise"]) == 1, order
    assert order.index(STARTING_TIERS["enterprise"]) <= 2, order
    done_enterprise = max(done for *_, done in answers["enterprise"])
    served_after = sum(done > done_enterprise for *_, done in answers["free"])
    assert served_after >= BATCH * (FREE_BATCHES - 3), served_after

    # The stats page: each tier's requests of the last minute, in its own row.
    def flushed_rows() -> dict[str, TierRow]:
        """The rows once every tier's requests are in the statistics (flushed once a second):
        every request of this test, and the one that found the key working (those before it
        were refused a key, in no tier)."""
        board = dashboard.build(
            client, tiered.env["SAMPLING_QUEUE"], Policy(), tier_order=list(STARTING_TIERS)
        )
        rows = {row.name: row for row in board.tiers}
        counted = all(
            tier in rows and round(rows[tier].goodput_rps * RECENT_S) == len(replies) + 1
            for tier, replies in answers.items()
        )
        return rows if counted else {}

    rows = wait_until(flushed_rows, 5, "every tier's requests in the statistics")
    assert list(rows) == ["enterprise", "free"]
    for tier in answers:
        assert rows[tier].rejected == rows[tier].timeouts == 0
    session = AdminSession(tiered.base_url)
    session.login(ADMIN_USER, ADMIN_PASSWORD)
    status, page = session.get("/admin/stats/")
    assert status == 200
    shown = [name for name in STARTING_TIERS if f'data-tier="{name}"' in page]
    assert shown == ["enterprise", "free"]
