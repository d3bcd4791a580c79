"""Rate limits: the request counter raised by the append's own MULTI, a process's refusals
from what it read, the x-ratelimit-* headers, and the tokens reserved and settled (real Redis)."""

from __future__ import annotations

import time
import uuid

import redis

from accounts import ratelimit
from accounts.access import Caller
from batching.aggregator import BatchAggregator
from batching.answers import Answer
from batching.catalog import Price
from batching.generation import SampleRequest
from batching.join import AppendCounter
from batching.keys import AccessKeys
from batching.outcomes import ItemOutcome
from serving.submission import Answers, charge
from telemetry.stats import RequestStats
from tests.support import unique_queue

WINDOW_START = 1_000 * ratelimit.WINDOW_S  # a window's first second


def caller(rpm: int = 0, tpm: int = 0, key_id: int = 42) -> Caller:
    return Caller(key_id, "client", "plus", 20, rpm, tpm)


def test_the_append_raises_the_counter_and_carries_the_key(redis_client: redis.Redis) -> None:
    aggregator = BatchAggregator(redis_client, unique_queue("rate"))
    counter = aggregator.shards[0].requests_counter(42, 7)
    first = aggregator.append("a", 500, key_id=42, counter=AppendCounter(counter, 5_000))
    second = aggregator.append(
        SampleRequest(prompt="b"), 500, key_id=42, counter=AppendCounter(counter)
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


def test_tokens_are_reserved_at_admission_and_settled_to_what_was_used(
    redis_client: redis.Redis,
) -> None:
    """A key with a tokens limit reserves each request's most; a request is refused once the
    window's tokens reached the limit, so requests in flight overrun it by one reservation at
    most; each settles to what it used, and another process refuses once it has read them."""
    keys = AccessKeys(scope=f"test-{uuid.uuid4().hex[:8]}")
    limiter = ratelimit.RateLimiter(redis_client, keys)
    other = ratelimit.RateLimiter(redis_client, keys)
    limited = caller(tpm=100)
    now = WINDOW_START + 1
    held = [limiter.reserve(limited, 40, now) for _ in range(4)]
    assert [isinstance(r, ratelimit.Reservation) for r in held] == [True, True, True, False]
    refusal = held[3]
    assert isinstance(refusal, ratelimit.Limited)
    assert refusal.kind == "tokens"
    window = keys.tokens(ratelimit.window_of(now))
    assert redis_client.hget(window, "42") == b"120"  # the limit and one reservation over
    first, second, _, _ = held
    assert isinstance(first, ratelimit.Reservation)
    assert isinstance(second, ratelimit.Reservation)
    first.settle(10)
    second.settle(0)  # it failed: nothing used
    second.settle(40)  # once only
    assert redis_client.hget(window, "42") == b"50"
    assert limiter.check(limited, now) is None
    assert other.check(limited, now) is None  # not read yet
    assert isinstance(limiter.reserve(limited, 60, now), ratelimit.Reservation)
    other.refresh_tokens(now)
    assert other.check(limited, now) is not None
    assert other.headers(limited, now)["x-ratelimit-remaining-tokens"] == "0"
    assert limiter.reserve(caller(), 40, now) is None  # no tokens limit: nothing reserved


def test_a_settle_after_its_window_is_gone_changes_nothing(redis_client: redis.Redis) -> None:
    """A request longer than its window's counts live (or Redis lost them): settling leaves no
    count behind, negative or without a TTL; and a count never goes below 0."""
    keys = AccessKeys(scope=f"test-{uuid.uuid4().hex[:8]}")
    limiter = ratelimit.RateLimiter(redis_client, keys)
    now = WINDOW_START + 1
    window = keys.tokens(ratelimit.window_of(now))
    late = limiter.reserve(caller(tpm=1000), 500, now)
    assert isinstance(late, ratelimit.Reservation)
    redis_client.delete(window)
    late.settle(0)
    assert not redis_client.exists(window)
    kept = limiter.reserve(caller(tpm=1000), 10, now)
    assert isinstance(kept, ratelimit.Reservation)
    redis_client.hset(window, "42", 3)  # less than it reserved: counted elsewhere meanwhile
    kept.settle(0)
    assert redis_client.hget(window, "42") == b"0"


def test_answers_without_counts_keep_their_reservation(redis_client: redis.Redis) -> None:
    """An anonymous /sample answer carries its text alone: its reservation stays whole, as the
    tokens it may have used, instead of settling to none."""
    keys = AccessKeys(scope=f"test-{uuid.uuid4().hex[:8]}")
    limiter = ratelimit.RateLimiter(redis_client, keys)
    anonymous = Caller(0, "anonymous", "anonymous", 0, 0, 100)
    answers = Answers([Answer(ItemOutcome.OK, "the text alone")])
    answers.reservation = limiter.reserve(anonymous, 32)  # type: ignore[assignment]
    charge(RequestStats("q"), anonymous, answers, Price())
    window = keys.tokens(ratelimit.window_of(time.time()))
    assert redis_client.hget(window, "0") == b"32"


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
