"""Rate limits: the request counter raised by the append's own MULTI, a process's refusals
from what it read, the x-ratelimit-* headers, and the workers' token charges (real Redis)."""

from __future__ import annotations

import uuid

import redis

from batching import ratelimit
from batching.access import Caller
from batching.aggregator import BatchAggregator
from batching.generation import SampleRequest
from batching.keys import AccessKeys
from batching.ratelimit import RateCounter
from tests.support import unique_queue

WINDOW_START = 1_000 * ratelimit.WINDOW_S  # a window's first second


def caller(rpm: int = 0, tpm: int = 0, key_id: int = 42) -> Caller:
    return Caller(key_id, "client", "plus", 20, rpm, tpm)


def test_the_append_raises_the_counter_and_carries_the_key(redis_client: redis.Redis) -> None:
    aggregator = BatchAggregator(redis_client, unique_queue("rate"))
    counter = aggregator.shards[0].requests_counter(42, 7)
    first = aggregator.append("a", 500, key_id=42, counter=RateCounter(counter, 5_000))
    second = aggregator.append(
        SampleRequest(prompt="b"), 500, key_id=42, counter=RateCounter(counter)
    )
    anonymous = aggregator.append("c", 500)
    assert (first.counted, second.counted, anonymous.counted) == (1, 2, 0)
    assert int(redis_client.get(counter) or 0) == 2
    assert 0 < redis_client.pttl(counter) <= 5_000
    items = aggregator.seal(first.batch_id).items
    assert [
        (item.key_id, item.prompt or (item.request and item.request.prompt)) for item in items
    ] == [
        (42, "a"),
        (42, "b"),
        (0, "c"),
    ]


def test_a_process_refuses_once_it_read_the_limit_until_the_window_ends(
    redis_client: redis.Redis,
) -> None:
    limiter = ratelimit.RateLimiter(redis_client)
    limited = caller(rpm=3)
    now = WINDOW_START + 10
    for count in (1, 2):
        limiter.counted(limited, count, now, expiry_set=False)
        assert limiter.check(limited, now) is None
    assert limiter.headers(limited, now)["x-ratelimit-remaining-requests"] == "1"
    limiter.counted(limited, 3, now, expiry_set=False)
    refusal = limiter.check(limited, now)
    assert refusal is not None
    assert (refusal.kind, refusal.limit, refusal.retry_after_s) == ("requests", 3, 50)
    headers = limiter.headers(limited, now)
    assert headers == {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "50s",
    }
    # Another key, and the next window, start afresh.
    assert limiter.check(caller(rpm=3, key_id=43), now) is None
    assert limiter.check(limited, WINDOW_START + ratelimit.WINDOW_S) is None
    # A key without limits is never refused and gets no headers.
    assert limiter.check(caller(), now) is None
    assert limiter.headers(caller(), now) == {}


def test_the_counter_expiry_is_set_once_per_window_per_process(
    redis_client: redis.Redis,
) -> None:
    limiter = ratelimit.RateLimiter(redis_client)
    limited = caller(rpm=3)
    assert limiter.needs_expiry(limited, WINDOW_START) == ratelimit.COUNTER_TTL_MS
    # An append that never ran (Redis away, or refused before its call) set nothing.
    assert limiter.needs_expiry(limited, WINDOW_START + 1) == ratelimit.COUNTER_TTL_MS
    limiter.counted(limited, 1, WINDOW_START + 1, expiry_set=True)
    assert limiter.needs_expiry(limited, WINDOW_START + 30) == 0
    assert limiter.needs_expiry(limited, WINDOW_START + ratelimit.WINDOW_S) > 0


def test_token_charges_refuse_the_key_once_read(redis_client: redis.Redis) -> None:
    keys = AccessKeys(scope=f"test-{uuid.uuid4().hex[:8]}")
    limiter = ratelimit.RateLimiter(redis_client, keys)
    limited = caller(tpm=100)
    now = WINDOW_START + 1
    with redis_client.pipeline(transaction=False) as pipe:
        ratelimit.queue_token_charges(pipe, {42: 60, 0: 5, 43: 0}, now, keys)
        ratelimit.queue_token_charges(pipe, {42: 40}, now, keys)
        pipe.execute()
    assert limiter.check(limited, now) is None  # not read yet
    limiter.refresh_tokens(now)
    refusal = limiter.check(limited, now)
    assert refusal is not None
    assert refusal.kind == "tokens"
    assert limiter.headers(limited, now)["x-ratelimit-remaining-tokens"] == "0"
    charges = redis_client.hgetall(keys.tokens(ratelimit.window_of(now)))
    assert charges == {b"42": b"100", b"0": b"5"}


def test_a_request_counts_once_or_per_item_as_the_operator_chooses(
    redis_client: redis.Redis,
) -> None:
    limited = caller(rpm=8)
    per_request = ratelimit.RateLimiter(redis_client)
    per_item = ratelimit.RateLimiter(redis_client, count_items=True)
    assert (per_request.cost(limited, 5), per_item.cost(limited, 5)) == (1, 5)


def test_a_process_asks_redis_first_only_near_the_limit(redis_client: redis.Redis) -> None:
    limiter = ratelimit.RateLimiter(redis_client)
    limited, now = caller(rpm=8), WINDOW_START + 1
    assert not limiter.near(limited, 1, now)  # nothing read yet: the plain append
    limiter.counted(limited, 5, now, expiry_set=False)
    assert not limiter.near(limited, 1, now)  # 6 of 8 is within NEAR_FRACTION
    assert limiter.near(limited, 2, now)
    assert not limiter.near(caller(), 100, now)  # no request limit
    refusal = limiter.refused(limited, 8, now)
    assert (refusal.kind, refusal.limit) == ("requests", 8)
    assert limiter.check(limited, now) is not None  # refused locally from now on
