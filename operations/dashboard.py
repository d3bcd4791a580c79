"""What the admin's stats page shows, read from Redis: charts of the last hour, the last
minute's figures (in all and per tier), the workers, and the GPU-count recommendation.

Django-free: a redis client, the queue and its policy in; plain data and SVG out.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis

from batching.keys import QueueKeys
from batching.outcomes import RequestOutcome
from batching.policy import Policy
from batching.registry import HEARTBEAT_TIMEOUT_MS, WorkerRegistry
from operations import charts
from telemetry import stats
from telemetry.batch_log import published_turn_ms
from telemetry.recommendation import (
    PEAK_WINDOW_S,
    Recommendation,
    from_traffic,
    recent_summary,
)

HOUR_S = 3600


@dataclass(frozen=True)
class WorkerRow:
    name: str
    host: str
    gpu: str
    sampler: str
    state: str  # idle, busy, hung, stopped, silent (no heartbeat for HEARTBEAT_TIMEOUT_MS)
    heartbeat_age_s: float | None
    batches: int
    busy_percent: float | None  # over the last minute
    estimate_ms: float | None
    policy_version: int | None  # the version it runs under (its heartbeat's)
    policy_refused: int | None = None  # a published version its sampler refused
    policy_refused_reason: str = ""

    @property
    def live(self) -> bool:
        return self.state not in (*stats.DEPARTED_STATES, "silent")


@dataclass(frozen=True)
class TierRow:
    """One tier's requests over the last minute."""

    name: str
    requests_rps: float
    goodput_rps: float  # completions (ok) per second
    goodput_percent: float | None  # of the tier's requests that asked for a completion
    rejected: int  # 503: refused by admission
    timeouts: int  # 504
    rate_limited: int  # 429
    p50_ms: float | None  # latency of all its answers
    p99_ms: float | None

    @classmethod
    def of(cls, name: str, summary: stats.Summary) -> TierRow:
        asked = summary.requests() - sum(
            summary.requests(outcome)
            for outcome in (RequestOutcome.BAD_REQUEST, RequestOutcome.RATE_LIMITED)
        )
        ok = summary.requests(RequestOutcome.OK)
        return cls(
            name=name,
            requests_rps=summary.rate(),
            goodput_rps=summary.rate(RequestOutcome.OK),
            goodput_percent=100 * ok / asked if asked else None,
            rejected=summary.requests(RequestOutcome.REJECTED),
            timeouts=summary.requests(RequestOutcome.TIMEOUT),
            rate_limited=summary.requests(RequestOutcome.RATE_LIMITED),
            p50_ms=summary.latency_percentile_ms(50),
            p99_ms=summary.latency_percentile_ms(99),
        )


@dataclass
class Dashboard:
    queue: str
    policy: Policy
    now: float
    recent: stats.Summary
    live_workers: int
    recommendation: Recommendation
    workers: list[WorkerRow] = field(default_factory=list)
    charts: list[str] = field(default_factory=list)
    tiers: list[TierRow] = field(default_factory=list)
    saved_version: int | None = None  # the saved policy's version; None: `policy`'s

    @property
    def peak_window_s(self) -> int:
        """The stretch of the last minute the recommendation plans for."""
        return PEAK_WINDOW_S

    @property
    def disagreeing_workers(self) -> list[WorkerRow]:
        """The live workers that do not run the saved policy (a sampler refused it, or the
        worker has not read it yet)."""
        saved = self.policy.version if self.saved_version is None else self.saved_version
        return [row for row in self.workers if row.live and row.policy_version != saved]

    @property
    def headline(self) -> list[tuple[str, str]]:
        recent = self.recent

        def number(value: float | None, fmt: str, unit: str = "") -> str:
            return "-" if value is None else f"{value:{fmt}}{unit}"

        def p50_p99(histogram: str) -> str:
            p50, p99 = (recent.latency_percentile_ms(q, histogram) for q in (50, 99))
            return f"{number(p50, ',.0f', ' ms')} / {number(p99, ',.0f', ' ms')}"

        failures = (RequestOutcome.TIMEOUT, RequestOutcome.REJECTED, RequestOutcome.ERROR)
        return [
            ("requests/s", number(recent.rate(), ",.1f")),
            ("completions/s (ok)", number(recent.rate(RequestOutcome.OK), ",.1f")),
            ("timeouts / rejected / errors", " / ".join(str(recent.requests(o)) for o in failures)),
            ("bad requests", str(recent.requests(RequestOutcome.BAD_REQUEST))),
            ("unauthorized (401)", str(recent.requests(RequestOutcome.UNAUTHORIZED))),
            ("rate limited (429)", str(recent.requests(RequestOutcome.RATE_LIMITED))),
            (
                "response cache hits / misses",
                f"{recent.counts[stats.CACHE_HITS]:,} / {recent.counts[stats.CACHE_MISSES]:,}"
                f" ({number(recent.cache_hit_percent(), '.0f', '%')} hits)",
            ),
            ("latency p50 / p99", p50_p99(stats.LATENCY)),
            ("time to first token p50 / p99 (streams)", p50_p99(stats.TTFT)),
            ("between tokens p50 / p99 (streams)", p50_p99(stats.ITL)),
            ("queue time p50 / p99 (arrival to call)", p50_p99(stats.QUEUE_TIME)),
            ("batches", f"{recent.batches:,}"),
            ("mean batch", number(recent.mean_batch(), ".1f")),
            ("batch fill", number(recent.fill_percent(), ".0f", "%")),
            ("expired before sampling", f"{recent.counts['expired']:,}"),
            ("queue wait (mean)", number(recent.mean_queue_wait_ms(), ",.1f", " ms")),
            ("sampling call (mean)", number(recent.mean_sampler_ms(), ",.1f", " ms")),
            ("GPU busy", number(recent.busy_percent(), ".0f", "%")),
            ("of which offline jobs alone", number(recent.backfill_busy_percent(), ".0f", "%")),
            ("live workers (GPUs)", str(self.live_workers)),
        ]


def build(
    client: redis.Redis,
    queue: str,
    policy: Policy,
    now: float | None = None,
    tier_order: Sequence[str] = (),
    saved_version: int | None = None,
) -> Dashboard:
    """The page's figures; its tiers in `tier_order` (highest priority first), then any other
    tier that had requests, by name; the workers compared with the saved policy's version
    (`saved_version`, by default `policy`'s)."""
    now = time.time() if now is None else now
    current_second = int(now)
    # Up to the bucket now filling, whose rates are over its elapsed seconds only.
    hour = stats.read_buckets(
        client, queue, stats.TEN_SECONDS, current_second - HOUR_S, current_second + 1
    )
    recent = recent_summary(client, queue, now)
    registry = WorkerRegistry(client, QueueKeys(queue))
    turn_ms = published_turn_ms(client, QueueKeys(queue))
    advice = from_traffic(recent, policy, registry.live_count(), turn_ms)
    live = advice.live_gpus
    dashboard = Dashboard(queue, policy, now, recent, live, advice, saved_version=saved_version)
    dashboard.workers = _workers(registry, recent, now)
    dashboard.charts = _charts(hour, policy, now)
    dashboard.tiers = _tiers(recent, tier_order)
    return dashboard


def _tiers(recent: stats.Summary, tier_order: Sequence[str]) -> list[TierRow]:
    by_tier = stats.tier_counts(recent.counts)
    rank = {name: index for index, name in enumerate(tier_order)}
    names = sorted(by_tier, key=lambda name: (rank.get(name, len(rank)), name))
    return [TierRow.of(name, stats.Summary(by_tier[name], recent.seconds)) for name in names]


def _workers(
    registry: WorkerRegistry,
    recent: stats.Summary,
    now: float,
) -> list[WorkerRow]:
    rows = []
    for name, info in registry.infos(now - stats.KNOWN_WORKERS_S):
        heartbeat_at = info.get("heartbeat_at")
        age = now - heartbeat_at if heartbeat_at else None
        state = info.get("state", "silent")
        # A worker that left says why (stats.DEPARTED_STATES); any other that stopped
        # beating is silent.
        if state not in stats.DEPARTED_STATES and (
            age is None or age * 1000 > HEARTBEAT_TIMEOUT_MS
        ):
            state = "silent"
        rows.append(
            WorkerRow(
                name=name,
                host=info.get("host", "?"),
                gpu=info.get("gpu") or "CPU",
                sampler=info.get("sampler", "?"),
                state=state,
                heartbeat_age_s=age,
                batches=int(info.get("batches", 0)),
                busy_percent=recent.busy_percent(name),
                estimate_ms=info.get("estimate_ms"),
                policy_version=info.get("policy_version"),
                policy_refused=info.get("policy_refused"),
                policy_refused_reason=str(info.get("policy_refused_reason") or ""),
            )
        )
    return sorted(rows, key=lambda row: (not row.live, row.name))


# The shortest span a chart shows: a service that started a minute ago gets readable lines
# rather than a few pixels at the right edge of an hour.
MIN_CHART_SPAN_S = 60


def _charts(hour: list[tuple[int, Counter[str]]], policy: Policy, now: float) -> list[str]:
    first_data = next((i for i, (_, counts) in enumerate(hour) if counts), len(hour))
    shown = max(0, min(first_data - 1, len(hour) - MIN_CHART_SPAN_S // stats.TEN_SECONDS))
    hour = hour[shown:]
    # Each point at its bucket's end; the last bucket is still filling, so it ends now.
    times = [min(start + stats.TEN_SECONDS, now) for start, _ in hour]
    summaries = [
        stats.Summary(counts, min(stats.TEN_SECONDS, max(1.0, now - start)))
        for start, counts in hour
    ]
    colors = {
        RequestOutcome.OK: charts.PALETTE["green"],
        RequestOutcome.TIMEOUT: charts.PALETTE["orange"],
        RequestOutcome.REJECTED: charts.PALETTE["purple"],
        RequestOutcome.BAD_REQUEST: charts.PALETTE["grey"],
        RequestOutcome.UNAUTHORIZED: charts.PALETTE["teal"],
        RequestOutcome.RATE_LIMITED: charts.PALETTE["blue"],
        RequestOutcome.ERROR: charts.PALETTE["red"],
        RequestOutcome.CANCELLED: charts.PALETTE["brown"],
    }
    requests = charts.line_chart(
        title="Requests per second, by outcome",
        times=times,
        now=now,
        series=[
            charts.Series(
                outcome.replace("_", " "),
                colors[outcome],
                [s.rate(outcome) if s.requests() else None for s in summaries],
            )
            for outcome in RequestOutcome
        ],
    )
    fill = charts.line_chart(
        title=f"Mean batch fill (% of the max batch size, {policy.max_batch_size} now)",
        times=times,
        now=now,
        unit="%",
        y_max=100,
        series=[
            charts.Series("fill", charts.PALETTE["blue"], [s.fill_percent() for s in summaries])
        ],
    )
    percentiles = (
        (50, charts.PALETTE["green"]),
        (95, charts.PALETTE["orange"]),
        (99, charts.PALETTE["red"]),
    )
    latency = charts.line_chart(
        title="Request latency (ms) against the deadline",
        times=times,
        now=now,
        unit=" ms",
        reference=charts.Reference(policy.deadline_ms, f"deadline {policy.deadline_ms:,} ms"),
        series=[
            charts.Series(f"p{q}", color, [s.latency_percentile_ms(q) for s in summaries])
            for q, color in percentiles
        ],
    )
    streams = _streams_chart(times, summaries, now)
    busy = charts.line_chart(
        title="GPU busy (% of worker time in sampling calls)",
        times=times,
        now=now,
        unit="%",
        y_max=100,
        series=[
            charts.Series("busy", charts.PALETTE["teal"], [s.busy_percent() for s in summaries])
        ],
    )
    return [requests, fill, latency, streams, busy]


def _streams_chart(times: list[float], summaries: list[stats.Summary], now: float) -> str:
    """Streams' time to first token, with the queue time of every request that waits in
    line for a call (streaming or not): the part of the first token's time before the call."""
    return charts.line_chart(
        title="Streams: time to first token, and queue time (ms)",
        times=times,
        now=now,
        unit=" ms",
        series=[
            charts.Series(
                f"{name} p{q}", color, [s.latency_percentile_ms(q, histogram) for s in summaries]
            )
            for name, histogram, q, color in (
                ("first token", stats.TTFT, 50, charts.PALETTE["green"]),
                ("first token", stats.TTFT, 99, charts.PALETTE["red"]),
                ("queue", stats.QUEUE_TIME, 50, charts.PALETTE["blue"]),
                ("queue", stats.QUEUE_TIME, 99, charts.PALETTE["purple"]),
            )
        ],
    )
