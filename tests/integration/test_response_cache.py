"""The response cache against real processes: an identical greedy or seeded request is
answered from Redis with exactly the first one's completion, no batch sampled for it, and
`x-cache` says so; hits and misses are counted in /metrics and the statistics."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable

import pytest
import redis
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from batching import stats
from batching.aggregator import BatchAggregator
from inference_site.lib.stack import Stack
from tests.support.http import request, sample
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cached(start_stack: Callable[..., Stack]) -> Stack:
    return start_stack(
        "cached", env={"SAMPLER": "simulated", "SAMPLING_RESPONSE_CACHE": "1"}, web_processes=2
    )


def lookups(stack: Stack) -> dict[str, float]:
    reply = request(stack.base_url, "/metrics", method="GET")
    return {
        sample.labels["result"]: sample.value
        for family in text_string_to_metric_families(reply.body)
        for sample in family.samples
        if sample.name == "sampling_cache_lookups_total"
    }


def sampled_items(stack: Stack) -> int:
    """Items the worker has sampled: the sizes in its batch log."""
    aggregator = BatchAggregator(
        redis.Redis.from_url(stack.env["REDIS_URL"]), stack.env["SAMPLING_QUEUE"]
    )
    return sum(json.loads(raw)["size"] for raw in aggregator.batch_log.recent())


def counted_in_stats(stack: Stack) -> tuple[int, int]:
    client = redis.Redis.from_url(stack.env["REDIS_URL"])
    now = int(time.time())
    buckets = stats.read_buckets(client, stack.env["SAMPLING_QUEUE"], stats.SECOND, now - 600,
                                 now + 1)  # fmt: skip
    counts = stats.merge(counts for _, counts in buckets)
    return counts[stats.CACHE_HITS], counts[stats.CACHE_MISSES]


def test_an_identical_request_is_answered_from_the_cache_exactly(cached: Stack) -> None:
    before, stats_before = lookups(cached), counted_in_stats(cached)
    items = sampled_items(cached)
    prompt = f"E equals {uuid.uuid4().hex[:8]} "
    first = sample(cached.base_url, prompt)
    assert (first.status, first.headers["x-cache"]) == (200, "miss")
    again = [sample(cached.base_url, prompt) for _ in range(4)]  # both web processes, likely
    assert {(reply.status, reply.headers["x-cache"], reply.body) for reply in again} == {
        (200, "hit", first.body)
    }
    # No GPU for the hits: once a later miss is logged (a worker logs a batch after it
    # answered it), two items were sampled in all.
    assert sample(cached.base_url, prompt + "later").headers["x-cache"] == "miss"
    wait_until(lambda: sampled_items(cached) >= items + 2, 5)
    assert sampled_items(cached) == items + 2

    client = OpenAI(base_url=f"{cached.base_url}/v1", api_key="EMPTY", max_retries=0)
    model = cached.env["SAMPLING_QUEUE"]
    settings = {"model": model, "prompt": prompt, "temperature": 0.9, "seed": 7, "max_tokens": 3}
    raw = client.completions.with_raw_response.create(**settings)  # type: ignore[call-overload]
    assert raw.headers["x-cache"] == "miss"
    sampled = raw.parse()
    raw = client.completions.with_raw_response.create(**settings)  # type: ignore[call-overload]
    assert raw.headers["x-cache"] == "hit"
    hit = raw.parse()
    assert [c.text for c in hit.choices] == [c.text for c in sampled.choices]
    assert [c.finish_reason for c in hit.choices] == [c.finish_reason for c in sampled.choices]
    # The same tokens, the hit's prompt reported as cached (OpenAI's cached_tokens).
    assert hit.usage is not None
    assert sampled.usage is not None
    assert hit.usage.model_dump(exclude={"prompt_tokens_details"}) == sampled.usage.model_dump(
        exclude={"prompt_tokens_details"}
    )
    assert hit.usage.prompt_tokens_details is not None
    assert hit.usage.prompt_tokens_details.cached_tokens == hit.usage.prompt_tokens
    assert sampled.usage.prompt_tokens_details is not None
    assert sampled.usage.prompt_tokens_details.cached_tokens == 0
    # A setting changed is another request; a sampled request without a seed is not cached.
    other = client.completions.with_raw_response.create(**{**settings, "seed": 8})  # type: ignore[call-overload]
    assert other.headers["x-cache"] == "miss"
    unseeded = {**settings, "seed": None}
    for _ in range(2):
        reply = client.completions.with_raw_response.create(**unseeded)  # type: ignore[call-overload]
        assert "x-cache" not in reply.headers

    hits, misses = 4 + 1, 1 + 1 + 1 + 1
    after = lookups(cached)
    assert after.get("hit", 0) - before.get("hit", 0) == hits
    assert after.get("miss", 0) - before.get("miss", 0) == misses

    def in_stats() -> bool:  # web processes flush their statistics once a second
        now = counted_in_stats(cached)
        return (now[0] - stats_before[0], now[1] - stats_before[1]) == (hits, misses)

    wait_until(in_stats, 5, "the lookups counted in the statistics")
