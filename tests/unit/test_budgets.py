from __future__ import annotations

import uuid
from datetime import UTC, datetime
from decimal import Decimal

import pytest
import redis

from batching.access import Caller
from batching.budgets import Budgets, budget_nanos
from batching.catalog import Price, nanos_as_decimal
from batching.flush import month_of
from batching.keys import QueueKeys
from batching.stats import RequestStats, read_buckets, usage_of

NOVEMBER = datetime(2026, 11, 30, 23, 59, 58, tzinfo=UTC).timestamp()
DECEMBER = NOVEMBER + 5


def test_spend_is_exact_in_billionths_for_prices_of_six_decimals() -> None:
    price = Price.per_thousand("1.5", "0.000001")
    assert price.of(3, 5) == 3 * 1_500_000 + 5 * 1
    assert nanos_as_decimal(price.of(3, 5)) == "0.004500005"
    with pytest.raises(ValueError, match="6 decimals"):
        Price.per_thousand("0.0000001", "0")
    assert budget_nanos(Decimal("0.05")) == 50_000_000
    assert (budget_nanos(None), budget_nanos(Decimal(0))) == (0, 1)


def test_a_flush_adds_each_key_s_spend_to_its_month_once(redis_client: redis.Redis) -> None:
    queue = f"test-spend-{uuid.uuid4().hex[:8]}"
    keys = QueueKeys(queue)
    stats = RequestStats(queue)
    stats.record_usage(7, 10, 5, 0, now=NOVEMBER, spend_nanos=1234)
    stats.record_usage(7, 1, 1, 0, now=DECEMBER, spend_nanos=10)
    stats.record_usage(8, 1, 1, 0, now=DECEMBER, spend_nanos=99)
    try:
        stats.flush(redis_client)
        assert redis_client.hgetall(keys.spend_of_month("2026-11")) == {b"7": b"1234"}
        assert redis_client.hgetall(keys.spend_of_month("2026-12")) == {b"7": b"10", b"8": b"99"}
        assert redis_client.ttl(keys.spend_of_month("2026-12")) > 60 * 24 * 3600
        # The buckets carry it too: usage rows get it from there.
        buckets = read_buckets(redis_client, queue, 10, int(NOVEMBER) - 10, int(DECEMBER) + 10)
        assert sum(usage_of(c)[7].spend_nanos for _, c in buckets if 7 in usage_of(c)) == 1244
    finally:
        redis_client.delete(*redis_client.keys(f"{keys.tag}*"))


def test_budgets_refuse_from_the_month_s_spend_across_models(redis_client: redis.Redis) -> None:
    models = [f"test-budget-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    month = month_of(NOVEMBER)
    for model, spent in zip(models, (600, 500), strict=True):
        redis_client.hset(QueueKeys(model).spend_of_month(month), "7", spent)
    budgets = Budgets(redis_client)
    capped = Caller(7, "k", "free", 0, budget_nanos=1100)
    try:
        budgets.refresh({7: 1100}, models, now_s=NOVEMBER)
        assert budgets.spent == {7: 1100}
        assert budgets.over(capped, now_s=NOVEMBER)
        assert not budgets.over(Caller(7, "k", "free", 0, budget_nanos=1101), now_s=NOVEMBER)
        assert not budgets.over(Caller(7, "k", "free", 0), now_s=NOVEMBER)  # no budget
        assert not budgets.over(capped, now_s=DECEMBER)  # a new month: nothing spent yet
    finally:
        for model in models:
            redis_client.delete(QueueKeys(model).spend_of_month(month))
