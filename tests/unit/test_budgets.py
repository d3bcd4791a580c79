from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from decimal import Decimal

import pytest
import redis

from accounts import budgets as budgets_module
from accounts.access import Caller, KeyRecord
from accounts.budgets import (
    KEY_HELD,
    KEY_SPENT,
    OWNER_HELD,
    OWNER_SPENT,
    Budgets,
    SpendHold,
    budget_nanos,
)
from batching.catalog import Price, nanos_as_decimal
from batching.keys import AccessKeys, QueueKeys
from telemetry.flush import month_of
from telemetry.stats import RequestStats, read_buckets, usage_of

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
        assert budgets.refusal(capped, now_s=NOVEMBER) == KEY_SPENT
        raised = Caller(7, "k", "free", 0, budget_nanos=1101)
        assert budgets.refusal(raised, now_s=NOVEMBER) is None
        assert budgets.refusal(Caller(7, "k", "free", 0), now_s=NOVEMBER) is None  # no budget
        assert budgets.refusal(capped, now_s=DECEMBER) is None  # a new month: nothing spent
    finally:
        for model in models:
            redis_client.delete(QueueKeys(model).spend_of_month(month))


def test_an_owner_s_budget_counts_all_its_keys_spend(redis_client: redis.Redis) -> None:
    models = [f"test-owner-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    month = month_of(NOVEMBER)
    spends = {"7": (300, 100), "8": (0, 150), "9": (1000, 0)}  # key -> spend on each model
    for index, model in enumerate(models):
        redis_client.hset(
            QueueKeys(model).spend_of_month(month),
            mapping={key: spent[index] for key, spent in spends.items()},
        )
    budgets = Budgets(redis_client)
    # Keys 7 and 8 are acme's; key 9 is another owner's, whose spend counts for nobody else.
    acme_total = sum(spends["7"]) + sum(spends["8"])

    def key_of(key_id: int, owner_budget: int, own_budget: int = 0) -> Caller:
        return Caller(key_id, "k", "free", 0, budget_nanos=own_budget, owner="acme",
                      owner_budget_nanos=owner_budget)  # fmt: skip

    try:
        budgets.refresh({}, models, now_s=NOVEMBER, owners_keys={"acme": {7, 8}})
        assert budgets.owners_spent == {"acme": acme_total}
        # Key 8 spent 150 alone: its owner's total refuses it, with the owner's reason.
        refusal = budgets.refusal(key_of(8, acme_total), now_s=NOVEMBER)
        assert refusal == OWNER_SPENT
        assert budgets.refusal(key_of(8, acme_total + 1), now_s=NOVEMBER) is None
        assert budgets.refusal(key_of(7, acme_total), now_s=DECEMBER) is None  # a new month
        # A key's own budget refuses it first, whatever its owner's says.
        budgets.refresh({7: 400}, models, now_s=NOVEMBER, owners_keys={"acme": {7, 8}})
        own = budgets.refusal(key_of(7, acme_total + 1, own_budget=400), now_s=NOVEMBER)
        assert own == KEY_SPENT
        # The same owner name without a budget published: nothing refused.
        assert budgets.refusal(key_of(8, 0), now_s=NOVEMBER) is None
    finally:
        for model in models:
            redis_client.delete(QueueKeys(model).spend_of_month(month))


def test_a_caller_reads_records_of_older_and_newer_publishers() -> None:
    caller = Caller(3, "k", "free", 1, 10, 20, 30, "acme", 40)
    record = KeyRecord(caller, expires_at=None, revoked=False)
    assert KeyRecord.from_json(record.to_json()) == record
    older = json.loads(record.to_json())
    del older["owner"], older["owner_budget_nanos"]  # a publisher before owners' budgets
    assert KeyRecord.from_json(json.dumps(older)).caller == Caller(3, "k", "free", 1, 10, 20, 30)
    newer = {**json.loads(record.to_json()), "some_later_field": 5}  # a rolling upgrade's
    assert KeyRecord.from_json(json.dumps(newer)) == record


def test_requests_in_flight_hold_the_budget_left_and_release_it_once_their_spend_is_read(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A budgeted key's requests hold their most cost at admission: one is refused once what
    they hold reaches what is left, whatever it would cost; an answer's hold falls to its
    spend at once, and to nothing after the flush that counts it (and its release delay)."""
    monkeypatch.setattr(budgets_module, "RELEASE_AFTER_FLUSH_S", 0.0)
    keys = AccessKeys(f"test-{uuid.uuid4().hex[:8]}")
    budgets = Budgets(redis_client, keys)
    budgets.refresh({7: 1000}, [], now_s=NOVEMBER)
    capped = Caller(7, "k", "free", 0, budget_nanos=1000)
    window = int(NOVEMBER // budgets_module.HOLD_WINDOW_S)
    held_key = keys.spend_holds(window)

    def held() -> int:
        return int(redis_client.hget(held_key, "k:7") or 0)

    try:
        assert budgets.hold(Caller(7, "k", "free", 0), 500, now_s=NOVEMBER) is None  # no budget
        first = budgets.hold(capped, 600, now_s=NOVEMBER)
        second = budgets.hold(capped, 600, now_s=NOVEMBER)  # 600 held < 1000 left: admitted
        assert isinstance(first, SpendHold)
        assert isinstance(second, SpendHold)
        assert budgets.hold(capped, 1, now_s=NOVEMBER) == KEY_HELD  # 1200 held >= 1000 left
        first.settle(100)  # answered: it spent 100
        assert held() == 700
        first.settle(0)  # once only
        assert held() == 700
        second.settle(0)  # failed: nothing spent, released at once
        assert held() == 100
        settled = budgets.take_settled()
        budgets.flushed(settled, ok=False)  # a failed flush keeps them for the next
        assert budgets.take_settled() == settled
        budgets.flushed(settled, ok=True)
        budgets.release_due()
        assert held() == 0
        # The next window still reads this one's holds: a request that lasts its deadline.
        later = budgets.hold(capped, 1000, now_s=NOVEMBER)
        assert isinstance(later, SpendHold)
        assert budgets.hold(capped, 1, now_s=NOVEMBER + 600) == KEY_HELD
        assert budgets.hold(capped, 1, now_s=NOVEMBER + budgets_module.HOLD_WINDOW_S) == KEY_HELD
    finally:
        redis_client.delete(held_key, keys.spend_holds(window + 1))


def test_an_owner_s_holds_count_all_its_keys_requests(redis_client: redis.Redis) -> None:
    keys = AccessKeys(f"test-{uuid.uuid4().hex[:8]}")
    budgets = Budgets(redis_client, keys)
    budgets.refresh({}, [], now_s=NOVEMBER, owners_keys={"acme": {7, 8}})

    def key_of(key_id: int) -> Caller:
        return Caller(key_id, "k", "free", 0, owner="acme", owner_budget_nanos=1000)

    try:
        assert isinstance(budgets.hold(key_of(7), 1000, now_s=NOVEMBER), SpendHold)
        assert budgets.hold(key_of(8), 1, now_s=NOVEMBER) == OWNER_HELD
        window = int(NOVEMBER // budgets_module.HOLD_WINDOW_S)
        assert redis_client.hgetall(keys.spend_holds(window)) == {b"o:acme": b"1000"}
    finally:
        redis_client.delete(keys.spend_holds(int(NOVEMBER // budgets_module.HOLD_WINDOW_S)))


def test_a_models_spend_counts_after_it_left_the_catalog(redis_client: redis.Redis) -> None:
    """Budgets sum every model with spend this month, not only those the catalog lists now:
    a model unregistered mid-month takes nothing off its keys' spend."""
    queue = f"test-gone-{uuid.uuid4().hex[:8]}"
    key_id = 10**9 + uuid.uuid4().int % 10**8  # no other test's key
    stats = RequestStats(queue)
    stats.record_usage(key_id, 10, 5, 0, now=NOVEMBER, spend_nanos=321)
    spent_models = AccessKeys().spent_models(month_of(NOVEMBER))
    try:
        stats.flush(redis_client)
        assert queue.encode() in redis_client.smembers(spent_models)
        budgets = Budgets(redis_client)
        budgets.refresh({key_id: 10**6}, [], now_s=NOVEMBER)  # the catalog lists it no more
        assert budgets.spent == {key_id: 321}
    finally:
        redis_client.srem(spent_models, queue)
        redis_client.delete(*redis_client.keys(f"{QueueKeys(queue).tag}*"))
