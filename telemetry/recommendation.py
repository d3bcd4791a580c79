"""How many GPUs the observed traffic needs: the stats page's recommendation.

A GPU runs one call at a time, each taking about `sampler_ms` whatever the batch size, so a
GPU whose batches are filled to `fill` of `max_batch_size` carries
max_batch_size x fill / sampler_s requests per second. The fewest GPUs for a rate is
therefore ceil(rate x sampler_s / (max_batch_size x fill target)). The fill target (below
100%) is the headroom: at 100% every GPU is busy all the time and any burst waits.

The same figure is the stats page's advice and the Prometheus gauges
`sampling_gpus_recommended` / `sampling_gpus_live` that an autoscaler (KEDA, an HPA on an
external metric) scales the workers on: `observed` reads it from a queue's last minute.

The rate planned for is the minute's busiest PEAK_WINDOW_S seconds, not its mean: a minute
with 20 s at 130% of one GPU's limit and 40 s at half of it averages under the limit, but its
burst refused requests (a 503 counts as demand). A burst so keeps the recommendation up for a
minute after it ends: scale-up follows demand within seconds, scale-down waits a minute (and
then the autoscaler's own stabilisation window).

Django-free: plain numbers (or a Redis client and a queue) in, a Recommendation out.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass

import redis

from batching.keys import QueueKeys
from batching.policy import Policy
from batching.registry import WorkerRegistry
from telemetry import stats
from telemetry.batch_log import published_turn_ms

RECENT_S = 60  # the window of the recommendation (and of the stats page's headline figures)
PEAK_WINDOW_S = 10  # the recommendation plans for the busiest this many seconds of the window

OVER = "over-provisioned"
UNDER = "under-provisioned"
RIGHT = "right-sized"
IDLE = "no traffic"


@dataclass(frozen=True)
class Recommendation:
    rate_rps: float
    sampler_ms: float
    max_batch_size: int
    fill_target_percent: int
    live_gpus: int
    needed_gpus: int
    mean_batch: float | None
    deadline_ms: int
    peak_rps: float | None = None  # the busiest PEAK_WINDOW_S seconds' demand, where known

    @property
    def planned_rps(self) -> float:
        """The rate the GPUs are counted for: the peak, or the mean without one."""
        return max(self.rate_rps, self.peak_rps or 0.0)

    @property
    def per_gpu_rps(self) -> float:
        """Requests/s one GPU carries at the fill target."""
        return self.max_batch_size * self.fill_target_percent / 100 / (self.sampler_ms / 1000)

    @property
    def verdict(self) -> str:
        if self.planned_rps <= 0:
            return IDLE
        if self.live_gpus > self.needed_gpus:
            return OVER
        if self.live_gpus < self.needed_gpus:
            return UNDER
        return RIGHT

    @property
    def message(self) -> str:
        gpus = _plural(self.live_gpus, "GPU")
        if self.verdict == IDLE:
            return f"no traffic with {gpus}: 1 GPU is enough to stay available"
        batch = f"average batch {self.mean_batch:,.0f}" if self.mean_batch is not None else ""
        head = f"{batch} with {gpus} at {self.rate_rps:,.0f} req/s".strip()
        if round(self.planned_rps) > round(self.rate_rps):
            head += f" (the busiest {PEAK_WINDOW_S} s: {self.planned_rps:,.0f} req/s)"
        surplus = self.live_gpus - self.needed_gpus
        if surplus > 0:
            advice = f"{_plural(surplus, 'GPU')} could be released"
        elif surplus < 0:
            advice = f"{_plural(-surplus, 'more GPU')} needed"
        else:
            advice = "right-sized"
        target = f"{self.needed_gpus} at a {self.fill_target_percent}% fill target"
        text = f"{head}: {advice} ({target})"
        if self.sampler_ms >= self.deadline_ms:
            text += (
                f"; but one call takes {self.sampler_ms:,.0f} ms, over the "
                f"{self.deadline_ms:,} ms deadline: more GPUs will not meet it"
            )
        return text


def needed_gpus(
    rate_rps: float, sampler_ms: float, max_batch_size: int, fill_target_percent: int
) -> int:
    """The fewest GPUs that carry `rate_rps` with batches filled to the target; 1 when idle
    (a service with no GPU answers nothing)."""
    if rate_rps <= 0:
        return 1
    # Integer-friendly order: 22,500 x 100 ms / (100 x 100%) is exactly 22.5, not 22.50..01.
    load = rate_rps * sampler_ms * 100 / (1000 * max_batch_size * fill_target_percent)
    return max(1, math.ceil(load - 1e-9))


def recommend(
    *,
    rate_rps: float,
    sampler_ms: float,
    max_batch_size: int,
    fill_target_percent: int,
    live_gpus: int,
    deadline_ms: int,
    mean_batch: float | None = None,
    peak_rps: float | None = None,
) -> Recommendation:
    planned_rps = max(rate_rps, peak_rps or 0.0)
    return Recommendation(
        rate_rps=rate_rps,
        sampler_ms=sampler_ms,
        max_batch_size=max_batch_size,
        fill_target_percent=fill_target_percent,
        live_gpus=live_gpus,
        needed_gpus=needed_gpus(planned_rps, sampler_ms, max_batch_size, fill_target_percent),
        mean_batch=mean_batch,
        deadline_ms=deadline_ms,
        peak_rps=peak_rps,
    )


def recent_summary(client: redis.Redis, queue: str, now: float | None = None) -> stats.Summary:
    """The queue's last RECENT_S whole seconds, summed over every process and worker, with
    the demand rate of their busiest PEAK_WINDOW_S."""
    current = int(time.time() if now is None else now)
    minute = stats.read_buckets(client, queue, stats.SECOND, current - RECENT_S, current)
    seconds = [counts for _, counts in minute]
    return stats.Summary(stats.merge(seconds), RECENT_S, peak_demand_rps=peak_demand(seconds))


def peak_demand(seconds: list[Counter[str]], window_s: int = PEAK_WINDOW_S) -> float:
    """The highest demand rate over `window_s` consecutive seconds of `seconds` (each one
    second's counts, in order); over all of them when there are fewer."""
    demand = [stats.Summary(counts, 1).demand_rate() for counts in seconds]
    window_s = max(1, min(window_s, len(demand)))
    if not demand:
        return 0.0
    total = best = sum(demand[:window_s])
    for i in range(window_s, len(demand)):
        total += demand[i] - demand[i - window_s]
        best = max(best, total)
    return best / window_s


def from_traffic(
    recent: stats.Summary, policy: Policy, live_gpus: int, turn_ms: float
) -> Recommendation:
    """The recommendation for `recent` traffic under `policy`, with `live_gpus` workers now.
    Without a call in the window, `turn_ms` (the workers' running estimate of a call) stands
    in."""
    sampler_ms = recent.mean_sampler_ms()
    if sampler_ms is None:
        sampler_ms = turn_ms
    return recommend(
        rate_rps=recent.demand_rate(),
        peak_rps=recent.peak_demand_rps,
        sampler_ms=sampler_ms or 1.0,
        max_batch_size=policy.max_batch_size,
        fill_target_percent=policy.fill_target_percent,
        live_gpus=live_gpus,
        deadline_ms=policy.deadline_ms,
        mean_batch=recent.mean_batch(),
    )


def observed(
    client: redis.Redis, queue: str, policy: Policy, now: float | None = None
) -> Recommendation:
    """The recommendation for the queue's last minute: three or four round trips to Redis."""
    keys = QueueKeys(queue)
    recent = recent_summary(client, queue, now)
    turn_ms = published_turn_ms(client, keys) if recent.mean_sampler_ms() is None else 0.0
    return from_traffic(recent, policy, WorkerRegistry(client, keys).live_count(), turn_ms)


def _plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"
