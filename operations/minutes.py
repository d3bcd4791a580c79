"""Completed minutes of statistics from Redis to the database: StatsMinute rows, and the keys'
usage in them to UsageMinute rows. Run by housekeeping (operations.housekeeping), one process
at a time under a Redis lock; idempotent whatever runs it again or dies half-way.

- Minutes are Redis's: the web processes' flushes are put in the node's time
  (telemetry/flush.py), and the newest minute that has ended is taken by the node's clock.
- A minute taken moves the persisted-minute marker and is marked dirty in one step
  (batching/lua/advance_persisted.lua); a flush that lands in a minute at or before the marker
  marks it dirty again (batching/lua/flush_stats.lua). Every dirty minute is written with its
  whole totals from the buckets (its rows replaced: set, not add), then its mark cleared only
  if no flush moved its version meanwhile (batching/lua/clear_dirty.lua). A late count is
  added to its minute, never dropped; a minute written twice holds the same totals.
- When the marker is missing (Redis lost its data, or no housekeeping ran for two hours), the
  rows already written for the minutes about to be taken are added to their buckets first, in
  the same step that sets the marker: the buckets then hold the minute's whole totals again
  (spend included), and replacing the rows from them loses nothing already persisted.
- When the stats epoch (QueueKeys.stats_epoch, never expiring, written whenever the marker is
  there) is missing with the marker, Redis lost its data: the month's spend totals that
  budgets read (accounts.budgets) get each key's spend of the month's persisted rows added
  back, in one step with the epoch, before any minute after the loss is written. (A Redis
  whose marker expired, its housekeeping stopped for two hours, while it was upgraded to a
  version that keeps the epoch, would count its month twice: the upgrade notes say so.)
"""

from __future__ import annotations

import secrets
from collections import Counter, defaultdict
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import redis
from django.db import transaction
from django.db.models import Sum

from batching import scripts
from batching.keys import QueueKeys
from operations.models import ApiKey, StatsMinute, UsageMinute
from telemetry import flush as flushing
from telemetry import stats

# A minute is taken once it ended this long ago (web processes flush once a second; a later
# count still reaches it, by the dirty mark).
GRACE_S = 15
# Not further back than the 10-second buckets are kept in Redis.
MAX_BACKLOG_MINUTES = stats.TTL_S[stats.TEN_SECONDS] // 60 - 5

_scripts: dict[tuple[int, str], Any] = {}


def _script(client: redis.Redis, name: str) -> Any:
    found = _scripts.get((id(client), name))
    if found is None:
        found = _scripts[(id(client), name)] = scripts.register(client, name)
    return found


def redis_now_s(client: redis.Redis) -> float:
    """The Redis node's time: the one clock minutes are counted by."""
    seconds, micros = client.time()
    return int(seconds) + int(micros) / 1e6


def persist_minutes(client: redis.Redis, queue: str, now_s: float) -> int:
    """Take every minute that ended (by `now_s`, Redis's time) and write every dirty minute;
    returns the number of statistics rows written."""
    keys = QueueKeys(queue)
    last = int(now_s - GRACE_S) // 60 - 1  # the newest minute that has ended
    oldest = last - MAX_BACKLOG_MINUTES
    if client.get(keys.persisted_minute) is None:
        if client.get(keys.stats_epoch) is None:  # Redis lost its data (or a first start)
            _rebuild_month_spend(client, queue, now_s)
        _seed_and_advance(client, queue, oldest, last)
    else:
        client.set(keys.stats_epoch, secrets.token_hex(6), nx=True)  # whole, as it is
        _advance(client, keys, last, oldest, [])
    dirty = {int(m): v.decode() for m, v in client.hgetall(keys.dirty_minutes).items()}
    if not dirty:
        return 0
    expired = [m for m in dirty if m < oldest]  # their buckets are gone: nothing to write
    clear = _script(client, "clear_dirty")
    for minute in expired:
        clear(keys=[keys.dirty_minutes], args=[minute, dirty.pop(minute)])
    if not dirty:
        return 0
    first, end = min(dirty), max(dirty) + 1
    buckets = stats.read_buckets(client, queue, stats.TEN_SECONDS, first * 60, end * 60)
    minutes: defaultdict[int, Counter[str]] = defaultdict(Counter)
    for start, counts in buckets:
        if start // 60 in dirty:
            minutes[start // 60].update(counts)
    written = _replace_rows(queue, {minute: minutes[minute] for minute in dirty})
    for minute, version in dirty.items():
        clear(keys=[keys.dirty_minutes], args=[minute, version])
    return written


def _advance(client: redis.Redis, keys: QueueKeys, last: int, oldest: int, seeds: list[str]) -> int:
    return int(
        _script(client, "advance_persisted")(
            keys=[keys.persisted_minute, keys.dirty_minutes],
            args=[last, oldest, stats.TTL_S[stats.TEN_SECONDS], keys.stats_prefix, *seeds],
        )
    )


def _rebuild_month_spend(client: redis.Redis, queue: str, now_s: float) -> None:
    """The month's spend totals of `queue` (Redis's month: its time) given back each key's
    spend in the month's persisted rows: Redis lost them, and holds only what was flushed
    since."""
    month = flushing.month_of(now_s)
    start = datetime.strptime(month, "%Y-%m").replace(tzinfo=UTC)
    rows = UsageMinute.objects.filter(queue=queue, minute__gte=start).exclude(key=None)
    spent = rows.values("key_id").annotate(spend=Sum("spend_nanos"))
    keys = QueueKeys(queue)
    total_key = keys.spend_of_month(month)
    with client.pipeline(transaction=True) as pipe:  # with the epoch: once, or again whole
        for row in spent:
            if row["spend"]:
                pipe.hincrby(total_key, str(row["key_id"]), row["spend"])
        pipe.expire(total_key, flushing.MONTH_TTL_S)
        pipe.set(keys.stats_epoch, secrets.token_hex(6))
        pipe.execute()
    flushing.note_spent(client, month, queue)


def _seed_and_advance(client: redis.Redis, queue: str, oldest: int, last: int) -> None:
    """Set the missing marker, with the rows already written for the minutes it takes added
    to their buckets in the same step (skipped by the script if another process set it)."""
    start = datetime.fromtimestamp(oldest * 60, tz=UTC)
    end = datetime.fromtimestamp((last + 1) * 60, tz=UTC)
    seeds: defaultdict[int, Counter[str]] = defaultdict(Counter)
    for row in StatsMinute.objects.filter(queue=queue, minute__gte=start, minute__lt=end):
        seeds[int(row.minute.timestamp()) // 60].update(row.counts)
    usage = UsageMinute.objects.filter(queue=queue, minute__gte=start, minute__lt=end)
    for used in usage.exclude(key=None):
        minute, key_id = int(used.minute.timestamp()) // 60, used.key_id or 0
        counts = seeds[minute]
        for outcome, count in used.requests.items():
            counts[stats.usage_field(key_id, "req:" + outcome)] += count
        counts[stats.usage_field(key_id, stats.PROMPT_TOKENS)] += used.prompt_tokens
        counts[stats.usage_field(key_id, stats.COMPLETION_TOKENS)] += used.completion_tokens
        counts[stats.usage_field(key_id, stats.CACHED_TOKENS)] += used.cached_tokens
        counts[stats.usage_field(key_id, stats.SPEND)] += used.spend_nanos
    flat = [
        str(part)
        for minute, counts in seeds.items()
        for field, value in counts.items()
        if value
        for part in (minute, field, value)
    ]
    _advance(client, QueueKeys(queue), last, oldest, flat)


def _replace_rows(queue: str, minutes: Mapping[int, Counter[str]]) -> int:
    """The minutes' rows replaced by their totals (a minute without counts keeps its rows:
    its buckets are gone); returns the statistics rows written."""
    minutes = {minute: counts for minute, counts in minutes.items() if counts}
    if not minutes:
        return 0
    moments = [datetime.fromtimestamp(minute * 60, tz=UTC) for minute in minutes]
    rows = [
        StatsMinute(
            queue=queue,
            minute=datetime.fromtimestamp(minute * 60, tz=UTC),
            counts=stats.without_usage(counts),
        )
        for minute, counts in sorted(minutes.items())
    ]
    usage = usage_rows(queue, minutes)
    with transaction.atomic():
        StatsMinute.objects.filter(queue=queue, minute__in=moments).delete()
        UsageMinute.objects.filter(queue=queue, minute__in=moments).delete()
        StatsMinute.objects.bulk_create(rows)
        UsageMinute.objects.bulk_create(usage)
    return len(rows)


def usage_rows(queue: str, minutes: Mapping[int, Counter[str]]) -> list[UsageMinute]:
    """The keys' usage rows of `minutes` (minute number -> counts); a key deleted since keeps
    its row, without the key."""
    used = {minute: stats.usage_of(counts) for minute, counts in minutes.items()}
    key_ids = {key_id for usage in used.values() for key_id in usage}
    tiers = dict(ApiKey.objects.filter(pk__in=key_ids).values_list("pk", "tier__name"))
    return [
        UsageMinute(
            queue=queue,
            minute=datetime.fromtimestamp(minute * 60, tz=UTC),
            key_id=key_id if key_id in tiers else None,
            tier=tiers.get(key_id, ""),
            requests=dict(usage.requests),
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            spend_nanos=usage.spend_nanos,
        )
        for minute, by_key in sorted(used.items())
        for key_id, usage in sorted(by_key.items())
    ]


def dirty_minutes(client: redis.Redis, queue: str) -> set[int]:
    """The minutes at or before the marker whose rows are behind their buckets."""
    return {int(minute) for minute in client.hkeys(QueueKeys(queue).dirty_minutes)}
