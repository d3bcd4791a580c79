"""What an API key used: `GET /v1/usage?date=YYYY-MM-DD` for the calling key, and the sums the
admin shows per key and per tier.

A key's usage lives in two places: the UsageMinute rows of the minutes housekeeping has
persisted (operations.housekeeping), and the statistics buckets in Redis for the minutes
after them (the current one included, up to the web processes' last flush, a second ago).
The queue's persisted-minute marker splits the two, so a minute is counted once whichever
side holds it when the request reads; a minute at or before the marker whose rows are behind
its buckets (dirty: a late count, or rows not written yet) is read from its buckets. Without
the marker (no minute taken since the first start or since Redis lost its data) the buckets
left hold only counts no row holds, and both are read.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

import redis
from django.db.models import QuerySet, Sum
from django.http import HttpRequest, HttpResponse

from accounts.access import Caller
from batching.catalog import nanos_as_decimal
from batching.keys import QueueKeys
from batching.outcomes import RequestOutcome
from batching.problems import Failure, Problem
from batching.topology import REDIS_FAULTS
from operations.models import ApiKey, UsageMinute, known_queues
from serving.redis_client import redis_client
from serving.responses import Invalid, json_response
from serving.wrappers import openai_endpoint
from telemetry import stats


@dataclass
class ModelUsage:
    model: str
    usage: stats.Usage

    def as_json(self) -> dict[str, object]:
        usage = self.usage
        return {
            "model": self.model,
            "usage": {
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
            },
            "requests": {"total": sum(usage.requests.values()), **dict(usage.requests)},
            "spend": nanos_as_decimal(usage.spend_nanos),
        }


def usage_of_key(client: redis.Redis, key_id: int, day: date, now_s: float) -> list[ModelUsage]:
    """The key's usage per model over the UTC day `day`, up to `now_s`."""
    start = datetime(day.year, day.month, day.day, tzinfo=UTC)
    end = start + timedelta(days=1)
    found: dict[str, stats.Usage] = {}
    for queue in sorted({*known_queues(), *_queues_used(key_id, start, end)}):
        usage = _usage_in_queue(client, QueueKeys(queue), key_id, (start, end), now_s)
        if usage is None:  # the marker was set while it read: read again, by the marker
            usage = _usage_in_queue(client, QueueKeys(queue), key_id, (start, end), now_s)
        if usage is not None and (usage.requests or usage.prompt_tokens or usage.completion_tokens):
            found[queue] = usage
    return [ModelUsage(queue, usage) for queue, usage in sorted(found.items())]


def _usage_in_queue(
    client: redis.Redis, keys: QueueKeys, key_id: int, day: tuple[datetime, datetime], now_s: float
) -> stats.Usage | None:
    """The key's usage of one queue over `day`: rows up to the persisted-minute marker (but its
    dirty minutes), buckets after it. None when the marker was missing at the start and set by
    the end (housekeeping's first run: the rows it seeded into the buckets were read twice)."""
    start, end = day
    start_s, end_s = start.timestamp(), end.timestamp()
    with client.pipeline(transaction=False) as pipe:
        pipe.get(keys.persisted_minute)
        pipe.hkeys(keys.dirty_minutes)
        marker, dirty_raw = pipe.execute()
    rows = UsageMinute.objects.filter(queue=keys.queue, key_id=key_id, minute__gte=start)
    rows = rows.filter(minute__lt=end)
    dirty = sorted(int(m) for m in dirty_raw if start_s <= int(m) * 60 < end_s)
    if marker is not None:  # minutes after it are in Redis only (or in both: not read here)
        persisted_until = datetime.fromtimestamp((int(marker) + 1) * 60, tz=UTC)
        rows = rows.filter(minute__lt=persisted_until)
        rows = rows.exclude(minute__in=[_moment(minute) for minute in dirty])
        unpersisted_from = max(start_s, persisted_until.timestamp())
    else:
        # No minute taken since Redis lost its data (or since the first start): the buckets
        # left hold only counts no row holds (operations.minutes), so both are read.
        unpersisted_from, dirty = max(start_s, now_s - stats.TTL_S[stats.TEN_SECONDS]), []
    usage = _sum_rows(rows)
    last = min(end_s, now_s + stats.TEN_SECONDS)
    spans = [(minute * 60, minute * 60 + 60) for minute in dirty]
    if unpersisted_from < last:
        spans.append((int(unpersisted_from), int(last)))
    for first, stop in spans:
        for _, counts in stats.read_buckets(client, keys.queue, stats.TEN_SECONDS, first, stop):
            recent = stats.usage_of(counts).get(key_id)
            if recent is not None:
                usage.add(recent)
    if marker is None and client.exists(keys.persisted_minute):
        return None
    return usage


@dataclass(frozen=True)
class Total:
    """One line of the admin's usage sums: a key or a tier, over the rows it was given."""

    label: str
    requests: int
    ok: int
    prompt_tokens: int
    completion_tokens: int
    spend: str = "0"  # nanos_as_decimal

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def totals(rows: QuerySet[UsageMinute], by: str) -> list[Total]:
    """`rows` summed per key (`by="key"`), per tier (`by="tier"`) or per model
    (`by="queue"`), the most tokens first."""
    requests: dict[object, Counter[str]] = {}
    for group, by_outcome in rows.values_list(by, "requests"):
        requests.setdefault(group, Counter()).update(by_outcome)
    sums = rows.values(by).annotate(
        prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"), spend=Sum("spend_nanos")
    )
    labels = _key_labels({row[by] for row in sums}) if by == "key" else {}
    found = [
        Total(
            labels.get(row[by], str(row[by] or "(deleted key)")),
            sum(requests.get(row[by], Counter()).values()),
            requests.get(row[by], Counter())[RequestOutcome.OK],
            row["prompt"] or 0,
            row["completion"] or 0,
            nanos_as_decimal(row["spend"] or 0),
        )
        for row in sums
    ]
    return sorted(found, key=lambda total: (-total.total_tokens, -total.requests, total.label))


def _key_labels(key_ids: set[object]) -> dict[object, str]:
    return {key.pk: str(key) for key in ApiKey.objects.filter(pk__in=key_ids)}


def _queues_used(key_id: int, start: datetime, end: datetime) -> set[str]:
    return set(
        UsageMinute.objects.filter(key_id=key_id, minute__gte=start, minute__lt=end)
        .values_list("queue", flat=True)
        .distinct()
    )


def _sum_rows(rows: QuerySet[UsageMinute]) -> stats.Usage:
    requests: Counter[str] = Counter()
    for by_outcome in rows.values_list("requests", flat=True):
        requests.update(by_outcome)
    tokens = rows.aggregate(
        prompt=Sum("prompt_tokens"),
        completion=Sum("completion_tokens"),
        cached=Sum("cached_tokens"),
        spend=Sum("spend_nanos"),
    )
    return stats.Usage(
        requests,
        tokens["prompt"] or 0,
        tokens["completion"] or 0,
        tokens["cached"] or 0,
        tokens["spend"] or 0,
    )


def _moment(minute: int) -> datetime:
    return datetime.fromtimestamp(minute * 60, tz=UTC)


# The days usage can be asked for: any a datetime holds with the day after it.
FIRST_DAY, LAST_DAY = date.min, date.max - timedelta(days=1)


def _day(raw: str | None, today: date) -> date:
    if raw is None or raw == "":
        return today
    try:
        day = date.fromisoformat(raw)
    except ValueError:
        raise Invalid(f"date must be YYYY-MM-DD, got {raw[:40]!r}", "date") from None
    if not FIRST_DAY <= day <= LAST_DAY:
        raise Invalid(f"date must be from {FIRST_DAY} to {LAST_DAY}, got {raw}", "date")
    return day


@openai_endpoint("GET", "HEAD", key_for="usage is counted per API key")
def usage_view(request: HttpRequest, caller: Caller) -> HttpResponse | Failure:
    """The calling key's usage per model on one UTC day (?date=, by default today), in the
    shape `{"object": "list", "date", "data": [{"model", "usage": {...}, "requests": {...}}]}`;
    requests without a key get 401 (usage is per key)."""
    now = datetime.now(tz=UTC)
    day = _day(request.GET.get("date"), now.date())
    try:
        used = usage_of_key(redis_client(), caller.key_id, day, now.timestamp())
    except REDIS_FAULTS:
        return Failure(Problem.UNAVAILABLE, "usage cannot be read: Redis unavailable")
    data = [model_usage.as_json() for model_usage in used]
    return json_response(200, {"object": "list", "date": day.isoformat(), "data": data})
