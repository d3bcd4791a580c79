"""Policy rows, their audit log and publishing, and the per-minute statistics rows: Django's
test database and a real Redis."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from django.test import override_settings
from django.utils import timezone

from accounts import access
from accounts.budgets import Budgets
from batching.keys import AccessKeys, QueueKeys
from batching.outcomes import RequestOutcome
from batching.policy import Policy
from operations import housekeeping, usage
from operations.models import (
    ApiKey,
    PolicyChange,
    SamplingPolicy,
    StatsMinute,
    Tier,
    UsageMinute,
    default_policy,
)
from serving import redis_client as web_redis
from telemetry import stats
from tests.support import unique_queue

pytestmark = pytest.mark.django_db


@pytest.fixture
def live_redis(settings: object, redis_url: str) -> Iterator[redis.Redis]:
    # The web client reads SAMPLING_REDIS_URL: without it the test used whatever served 6379.
    settings.REDIS_URL = settings.SAMPLING_REDIS_URL = redis_url  # type: ignore[attr-defined]
    web_redis.forget_clients()
    yield web_redis.redis_client()
    web_redis.forget_clients()


def test_a_saved_policy_is_audited_and_published(
    live_redis: redis.Redis, django_capture_on_commit_callbacks: object
) -> None:
    queue = unique_queue("adm")
    with django_capture_on_commit_callbacks(execute=True):  # type: ignore[operator]
        row = SamplingPolicy(queue=queue, max_batch_size=5)
        row.save(changed_by="alice")
    assert Policy.from_json(live_redis.get(QueueKeys(queue).policy)) == row.as_policy()
    assert row.version == 1

    with django_capture_on_commit_callbacks(execute=True):  # type: ignore[operator]
        row.deadline_ms = 250
        row.save(changed_by="bob")
    published = Policy.from_json(live_redis.get(QueueKeys(queue).policy))
    assert (published.version, published.deadline_ms, published.max_batch_size) == (2, 250, 5)

    with django_capture_on_commit_callbacks(execute=True):  # type: ignore[operator]
        row.delete(changed_by="carol")
    assert live_redis.get(QueueKeys(queue).policy) is None  # back to the environment's settings

    changes = list(PolicyChange.objects.filter(queue=queue).order_by("version"))
    assert [(c.version, c.action, c.changed_by) for c in changes] == [
        (1, "created", "alice"), (2, "changed", "bob"), (3, "deleted", "carol"),
    ]  # fmt: skip
    defaults = default_policy()
    assert changes[0].differences() == {"max_batch_size": (defaults.max_batch_size, 5)}
    assert changes[1].summary() == f"deadline_ms: {defaults.deadline_ms!r} → 250"
    assert changes[2].new["max_batch_size"] == defaults.max_batch_size


def test_housekeeping_republishes_what_redis_lost(live_redis: redis.Redis) -> None:
    queue = unique_queue("adm")
    row = SamplingPolicy(queue=queue, max_batch_size=9)
    row.save(changed_by="alice")  # no on_commit here: as if Redis had been down
    assert live_redis.get(QueueKeys(queue).policy) is None
    housekeeping.reconcile_policy(live_redis, queue, default_policy())
    assert Policy.from_json(live_redis.get(QueueKeys(queue).policy)).max_batch_size == 9


def test_minutes_are_persisted_once_and_pruned(live_redis: redis.Redis, settings: object) -> None:
    queue = unique_queue("adm")
    now = 1_800_000_000.0 - 1_800_000_000 % 60 + 30  # half a minute into a minute
    minute = int(now) // 60 * 60
    with live_redis.pipeline() as pipe:
        # two and three minutes ago (both complete), and one now (not complete yet)
        stats.add_counts(pipe, queue, minute - 120 + 5, {"req:ok": 3, "batches": 1, "items": 3})
        stats.add_counts(pipe, queue, minute - 120 + 45, {"req:ok": 2})
        stats.add_counts(pipe, queue, minute - 180 + 1, {"req:timeout": 1})
        stats.add_counts(pipe, queue, now, {"req:ok": 100})
        pipe.execute()
    assert housekeeping.persist_minutes(live_redis, queue, now) == 2
    rows = {r.minute: r.summary for r in StatsMinute.objects.filter(queue=queue)}
    two_ago = datetime.fromtimestamp(minute - 120, tz=UTC)
    assert rows[two_ago].requests() == 5
    assert rows[two_ago].batches == 1
    assert rows[datetime.fromtimestamp(minute - 180, tz=UTC)].requests(RequestOutcome.TIMEOUT) == 1
    assert housekeeping.persist_minutes(live_redis, queue, now) == 0  # nothing twice

    StatsMinute.objects.create(
        queue=queue, minute=timezone.now() - timedelta(days=31), counts={"req:ok": 1}
    )
    assert housekeeping.prune(queue, retention_days=30) == 1  # the 31-day-old row only
    assert StatsMinute.objects.filter(queue=queue).count() == 2


def test_usage_goes_to_its_own_rows_and_reads_back_whole_across_the_marker(
    live_redis: redis.Redis,
) -> None:
    queue = unique_queue("use")
    tier = Tier.objects.get(name="plus")
    key = ApiKey(name="metered", tier=tier)
    key.issue()
    key.save()
    now = 1_800_000_000.0 - 1_800_000_000 % 60 + 30
    minute = int(now) // 60 * 60
    old = {
        stats.usage_field(key.pk, "req:" + RequestOutcome.OK): 3,
        stats.usage_field(key.pk, "req:" + RequestOutcome.RATE_LIMITED): 1,
        **stats.token_counts({key.pk: (12, 30), 0: (5, 5)}),  # anonymous: no key's usage
        "req:ok": 4,
    }
    recent = {stats.usage_field(key.pk, "req:" + RequestOutcome.OK): 2,
              **stats.token_counts({key.pk: (7, 9)})}  # fmt: skip
    with live_redis.pipeline() as pipe:
        stats.add_counts(pipe, queue, minute - 120 + 5, old)
        stats.add_counts(pipe, queue, now, recent)  # the current minute: not persisted yet
        pipe.execute()
    housekeeping.persist_minutes(live_redis, queue, now)
    [row] = UsageMinute.objects.filter(queue=queue)
    assert (row.key, row.tier, row.prompt_tokens, row.completion_tokens) == (key, "plus", 12, 30)
    assert row.requests == {RequestOutcome.OK: 3, RequestOutcome.RATE_LIMITED: 1}
    [statistics] = StatsMinute.objects.filter(queue=queue)
    assert statistics.counts == {"req:ok": 4}  # the queue's figures only

    day = datetime.fromtimestamp(now, tz=UTC).date()
    with override_settings(SAMPLING_QUEUE=queue):
        [used] = usage.usage_of_key(live_redis, key.pk, day, now)
    assert used.model == queue
    assert used.usage.requests == {RequestOutcome.OK: 5, RequestOutcome.RATE_LIMITED: 1}
    assert (used.usage.prompt_tokens, used.usage.completion_tokens) == (19, 39)
    # A minute persisted after the marker was read is not counted twice: rows past the
    # marker are left to Redis.
    live_redis.set(QueueKeys(queue).persisted_minute, minute // 60 - 3)
    with override_settings(SAMPLING_QUEUE=queue):
        [again] = usage.usage_of_key(live_redis, key.pk, day, now)
    assert again.usage == used.usage

    [by_tier] = usage.totals(UsageMinute.objects.filter(queue=queue), "tier")
    assert (by_tier.label, by_tier.requests, by_tier.ok, by_tier.total_tokens) == ("plus", 4, 3, 42)
    key.delete()  # the rows stay, without the key
    assert UsageMinute.objects.get(queue=queue).key is None


def _own_scope() -> AccessKeys:
    """Keys of a scope no writer of spend notes models in: budgets read only the queues
    given (other tests' queues hold spend of the same database ids)."""
    return AccessKeys(f"test-{unique_queue('scope')}")


def _key(name: str) -> ApiKey:
    key = ApiKey(name=name, tier=Tier.objects.get(name="plus"))
    key.issue()
    key.save()
    return key


def test_a_count_flushed_into_a_persisted_minute_is_added_to_its_rows(
    live_redis: redis.Redis,
) -> None:
    queue = unique_queue("late")
    key = _key("late")
    now = float(live_redis.time()[0])
    in_minute = (int(now) // 60 - 2) * 60 + 30  # a minute that has ended
    recorder = stats.RequestStats(queue)
    recorder.record(RequestOutcome.OK, 0.1, now=in_minute, key_id=key.pk)
    recorder.record_usage(key.pk, 5, 3, 0, now=in_minute)
    recorder.flush(live_redis)
    assert housekeeping.persist_minutes(live_redis, queue, now) == 1
    # A process's flush late by a minute (Redis was away): its counts land in that minute.
    recorder.record(RequestOutcome.OK, 0.1, now=in_minute, key_id=key.pk)
    recorder.record_usage(key.pk, 7, 2, 7, now=in_minute)
    recorder.flush(live_redis)
    day = datetime.fromtimestamp(now, tz=UTC).date()
    with override_settings(SAMPLING_QUEUE=queue):  # read back before housekeeping: whole
        [used] = usage.usage_of_key(live_redis, key.pk, day, now)
    assert (used.usage.prompt_tokens, used.usage.completion_tokens) == (12, 5)
    housekeeping.persist_minutes(live_redis, queue, now)
    [row] = UsageMinute.objects.filter(queue=queue)
    assert (row.prompt_tokens, row.completion_tokens, row.cached_tokens) == (12, 5, 7)
    assert row.requests == {RequestOutcome.OK: 2}
    assert StatsMinute.objects.get(queue=queue).counts["req:ok"] == 2
    housekeeping.persist_minutes(live_redis, queue, now)  # again: the same totals, not more
    assert UsageMinute.objects.get(queue=queue).prompt_tokens == 12
    with override_settings(SAMPLING_QUEUE=queue):
        [used] = usage.usage_of_key(live_redis, key.pk, day, now)
    assert (used.usage.prompt_tokens, used.usage.cached_tokens) == (12, 7)


def test_rows_written_before_redis_lost_its_data_are_kept_when_new_counts_come(
    live_redis: redis.Redis,
) -> None:
    queue = unique_queue("lost")
    key = _key("lost")
    now = float(live_redis.time()[0])
    in_minute = (int(now) // 60 - 2) * 60 + 30
    recorder = stats.RequestStats(queue)
    recorder.record_usage(key.pk, 5, 3, 0, now=in_minute)
    recorder.flush(live_redis)
    housekeeping.persist_minutes(live_redis, queue, now)
    for name in live_redis.scan_iter(f"{QueueKeys(queue).tag}:*"):  # Redis restarted empty
        live_redis.delete(name)
    recorder.record_usage(key.pk, 1, 1, 0, now=in_minute)  # a flush kept through the restart
    recorder.flush(live_redis)
    housekeeping.persist_minutes(live_redis, queue, now)
    [row] = UsageMinute.objects.filter(queue=queue)
    assert (row.prompt_tokens, row.completion_tokens) == (6, 4)
    housekeeping.persist_minutes(live_redis, queue, now)
    assert UsageMinute.objects.get(queue=queue).prompt_tokens == 6


def test_usage_counts_what_was_flushed_before_the_first_minute_was_taken(
    live_redis: redis.Redis,
) -> None:
    """No persisted-minute marker yet (a fresh start, or Redis restarted empty and housekeeping
    not run since): the rows written before and the counts flushed since are both the key's."""
    queue = unique_queue("nomark")
    key = _key("nomark")
    now = float(live_redis.time()[0])
    day = datetime.fromtimestamp(now, tz=UTC).date()
    recorder = stats.RequestStats(queue)
    recorder.record(RequestOutcome.OK, 0.1, now=now, key_id=key.pk)
    recorder.record_usage(key.pk, 5, 3, 0, now=now)
    recorder.flush(live_redis)
    assert live_redis.get(QueueKeys(queue).persisted_minute) is None
    with override_settings(SAMPLING_QUEUE=queue):
        [fresh] = usage.usage_of_key(live_redis, key.pk, day, now)
    assert (fresh.usage.prompt_tokens, fresh.usage.completion_tokens) == (5, 3)
    assert fresh.usage.requests == {RequestOutcome.OK: 1}

    housekeeping.persist_minutes(live_redis, queue, now + 120)  # this minute taken: a row
    assert UsageMinute.objects.get(queue=queue).prompt_tokens == 5
    for name in live_redis.scan_iter(f"{QueueKeys(queue).tag}:*"):  # Redis restarted empty
        live_redis.delete(name)
    recorder.record_usage(key.pk, 2, 1, 0, now=now)
    recorder.flush(live_redis)
    with override_settings(SAMPLING_QUEUE=queue):
        [after] = usage.usage_of_key(live_redis, key.pk, day, now)
    assert (after.usage.prompt_tokens, after.usage.completion_tokens) == (7, 4)
    housekeeping.persist_minutes(live_redis, queue, now + 120)  # the marker again: the same sum
    with override_settings(SAMPLING_QUEUE=queue):
        [persisted] = usage.usage_of_key(live_redis, key.pk, day, now + 120)
    assert (persisted.usage.prompt_tokens, persisted.usage.completion_tokens) == (7, 4)


def test_last_use_is_copied_in_a_few_queries_and_deleted_keys_are_dropped(
    live_redis: redis.Redis, django_assert_max_num_queries: Any
) -> None:
    tier = Tier.objects.get(name="free")
    keys = [ApiKey(name=f"used {i}", tier=tier) for i in range(1200)]
    for key in keys:
        key.issue()
    ApiKey.objects.bulk_create(keys)
    ids = list(ApiKey.objects.filter(name__startswith="used ").values_list("pk", flat=True))
    gone = max(ids) + 10_000  # a key deleted since it was last seen
    at = int(timezone.now().timestamp())
    live_redis.hset(access.KEYS.last_used, mapping={**{str(i): at for i in ids}, str(gone): at})
    try:
        # 1,200 keys: three reads and three writes of 500, not a query per key.
        with django_assert_max_num_queries(8):
            assert housekeeping.record_last_used(live_redis) == len(ids)
        assert live_redis.hget(access.KEYS.last_used, str(gone)) is None
        moment = datetime.fromtimestamp(at, tz=UTC)
        assert set(ApiKey.objects.filter(pk__in=ids).values_list("last_used", flat=True)) == {
            moment
        }
        assert housekeeping.record_last_used(live_redis) == 0  # nothing newer
    finally:
        live_redis.hdel(access.KEYS.last_used, *[str(i) for i in ids])


def test_spend_and_month_totals_are_the_same_after_redis_lost_its_data(
    live_redis: redis.Redis,
) -> None:
    """Spend persisted, then Redis restarted empty: the persisted minute keeps its spend once
    it is written again, and the month's total that budgets read is rebuilt from the rows."""
    queue = unique_queue("spent")
    key, other = _key("spent"), _key("spent-too")
    now = float(live_redis.time()[0])
    in_minute = (int(now) // 60 - 2) * 60 + 30
    recorder = stats.RequestStats(queue)
    recorder.record_usage(key.pk, 5, 3, 0, now=in_minute, spend_nanos=700)
    recorder.record_usage(other.pk, 1, 1, 0, now=in_minute, spend_nanos=40)
    recorder.flush(live_redis)
    housekeeping.persist_minutes(live_redis, queue, now)
    budgets = Budgets(live_redis, _own_scope())  # this queue's spend only
    budgets.refresh({key.pk: 10**6, other.pk: 10**6}, [queue], now_s=now)
    before = dict(budgets.spent)
    assert before == {key.pk: 700, other.pk: 40}
    for name in live_redis.scan_iter(f"{QueueKeys(queue).tag}:*"):  # Redis restarted empty
        live_redis.delete(name)
    recorder.record_usage(key.pk, 1, 1, 0, now=now, spend_nanos=5)  # spent since the restart
    recorder.flush(live_redis)
    housekeeping.persist_minutes(live_redis, queue, now)
    housekeeping.persist_minutes(live_redis, queue, now)  # again: nothing added twice
    assert UsageMinute.objects.get(queue=queue, key=key).spend_nanos == 700
    budgets.refresh({key.pk: 10**6, other.pk: 10**6}, [queue], now_s=now)
    assert budgets.spent == {key.pk: 705, other.pk: 40}


def test_a_marker_that_expired_in_an_intact_redis_rebuilds_nothing(
    live_redis: redis.Redis,
) -> None:
    """Housekeeping stopped for over two hours with Redis kept: the marker expired, but the
    epoch written while it was there says the month's totals are whole."""
    queue = unique_queue("idle")
    key = _key("idle")
    now = float(live_redis.time()[0])
    recorder = stats.RequestStats(queue)
    recorder.record_usage(key.pk, 5, 3, 0, now=(int(now) // 60 - 2) * 60 + 30, spend_nanos=70)
    recorder.flush(live_redis)
    housekeeping.persist_minutes(live_redis, queue, now)
    housekeeping.persist_minutes(live_redis, queue, now)  # the marker there: the epoch too
    live_redis.delete(QueueKeys(queue).persisted_minute)
    housekeeping.persist_minutes(live_redis, queue, now)
    budgets = Budgets(live_redis, _own_scope())  # this queue's spend only
    budgets.refresh({key.pk: 10**6}, [queue], now_s=now)
    assert budgets.spent == {key.pk: 70}
