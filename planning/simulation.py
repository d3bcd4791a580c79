"""A discrete-event simulation of the batching policy: what the capacity planner predicts from.

It plays the same rules as batching/aggregator.py and workers/runner.py, with Poisson
arrivals and GPUs that each run one call at a time:
  - a request joins the open batch; the request that opens a batch enqueues its task (FIFO,
    the Celery queue); a batch reaching the max size is closed to newcomers;
  - lazy sealing: a free GPU takes the oldest queued task and seals its batch then, with
    every item that joined so far (so batches grow while every GPU is busy);
  - deadline drops: an item whose deadline is before seal time + one call is dropped (504)
    without being sampled;
  - admission: with batches queued behind every GPU, a request is refused at once (503) when
    the predicted finish of its batch is past its deadline (batching.admission, the same
    formula the per-batch scripts run, with the running calls' ends as their seals saw them).
On a cost curve (`cost`, batching.call_cost, with the requests' `shapes`, planning.shapes), a
call lasts what its rows' shape costs, the deadline cut predicts the sealed batch's own call,
and admission's turn is the running mean of the calls, as a worker's is.
Times are in ms. The fixed costs around the GPU are parameters: `path_ms` (a call's end to the
client's answer, added to each answer), `dispatch_ms` (a batch's first request to its seal
by an idle worker) and `gap_ms` (a worker's time between calls); their defaults are the
measured ones of planning/costs.py. Django-free.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from batching import admission
from batching.call_cost import CostProfile
from batching.policy import MAX_BATCH_SIZE
from planning.costs import MEASURED
from planning.shapes import RequestShapes

# Weight of the newest call in the running mean of a turn (workers.call_costs.ESTIMATE_WEIGHT).
TURN_WEIGHT = 0.3


@dataclass(frozen=True)
class Scenario:
    rate_rps: float
    gpus: int
    batch_ms: float = 100.0
    max_batch: int = MAX_BATCH_SIZE
    deadline_ms: float = 500.0
    duration_s: float = 10.0
    path_ms: float = MEASURED.path_ms
    dispatch_ms: float = MEASURED.dispatch_ms
    gap_ms: float = MEASURED.gap_ms
    seed: int = 1
    cost: CostProfile | None = None  # None: every call `batch_ms`
    shapes: RequestShapes | None = None  # the requests' shapes, on a cost curve

    @property
    def on_curve(self) -> bool:
        return self.cost is not None and not self.cost.is_contract and self.shapes is not None

    @property
    def full_call_ms(self) -> float:
        """A full batch's call: `batch_ms`, or on a curve the mean of full batches' calls."""
        if not self.on_curve:
            return self.batch_ms
        assert self.cost is not None
        assert self.shapes is not None
        return self.shapes.mean_call_ms(self.cost, self.max_batch, self.seed)

    @property
    def full_batch_gpus(self) -> float:
        """GPUs kept busy all the time by the rate in full batches, a turn being one call and
        the gap before the next: rate x (call + gap) / max batch."""
        return self.rate_rps * (self.full_call_ms + self.gap_ms) / 1000 / self.max_batch

    @property
    def lower_bound_gpus(self) -> int:
        """The fewest GPUs whose full batches carry more than the rate. At exactly the rate a
        queue is critically loaded: it grows without bound over a long enough run (a short
        simulation would not show it), until admission refuses."""
        return max(1, math.floor(self.full_batch_gpus) + 1)


@dataclass
class Outcome:
    scenario: Scenario
    latencies_ms: list[float] = field(default_factory=list)  # of ok answers only
    # Every answer as a client times it: ok ones, timeouts (504) at the deadline, rejections
    # by admission (503) at once.
    answers_ms: list[float] = field(default_factory=list)
    requests: int = 0
    timeouts: int = 0  # RequestOutcome.TIMEOUT
    rejected: int = 0  # RequestOutcome.REJECTED
    calls: int = 0
    sampled: int = 0
    expired: int = 0
    busy_ms: float = 0.0

    @property
    def mean_call_ms(self) -> float:
        return self.busy_ms / self.calls if self.calls else 0.0

    @property
    def ok(self) -> int:
        return len(self.latencies_ms)

    @property
    def goodput_rps(self) -> float:
        return self.ok / self.scenario.duration_s

    @property
    def ok_share(self) -> float:
        return self.ok / self.requests if self.requests else 1.0

    @property
    def mean_batch(self) -> float:
        return self.sampled / self.calls if self.calls else 0.0

    @property
    def busy_share(self) -> float:
        return self.busy_ms / (self.scenario.gpus * self.scenario.duration_s * 1000)

    def percentile_ms(self, q: float) -> float:
        """Latency percentile over every request, a failed one (503, 504) counting as
        infinitely late: inf when more than 100 - q percent failed."""
        if not self.requests:
            return float("nan")
        rank = max(1, math.ceil(self.requests * q / 100))
        if rank > self.ok:
            return math.inf
        return sorted(self.latencies_ms)[rank - 1]

    def answer_percentile_ms(self, q: float) -> float:
        """Latency percentile over every answer, as a load generator measures it."""
        if not self.answers_ms:
            return float("nan")
        ordered = sorted(self.answers_ms)
        return ordered[max(1, math.ceil(len(ordered) * q / 100)) - 1]


class _Batch:
    __slots__ = ("arrivals", "opened_ms", "shapes")

    def __init__(self, opened_ms: float) -> None:
        self.opened_ms = opened_ms
        self.arrivals: list[float] = []
        self.shapes: list[tuple[int, int]] = []  # each arrival's, on a cost curve


def simulate(scenario: Scenario) -> Outcome:
    s = scenario
    rng = random.Random(s.seed)  # noqa: S311 - a seeded simulation, not a secret
    outcome = Outcome(s)
    free_at = [0.0] * s.gpus  # heap: when each GPU can take its next task
    queued: deque[_Batch] = deque()  # batches whose task waits for a GPU (the open one too)
    open_batch: _Batch | None = None
    deadline, call = s.deadline_ms, s.batch_ms
    shapes_rng = random.Random(s.seed + 1)  # noqa: S311 - apart: the same arrivals on any cost
    turn_ms = s.full_call_ms + s.gap_ms  # admission's running mean of a turn
    call_ends: deque[float] = deque(maxlen=s.gpus)  # the latest calls' ends, as their seals saw

    def call_of(shapes: list[tuple[int, int]]) -> float:
        if not s.on_curve or not shapes:
            return s.batch_ms
        assert s.cost is not None
        assert s.shapes is not None
        return s.shapes.call_ms(s.cost, shapes)

    def seal_until(now: float) -> None:
        nonlocal open_batch, call, turn_ms
        while queued:
            head = queued[0]
            sealed_at = max(free_at[0], head.opened_ms + s.dispatch_ms)
            if sealed_at > now:
                return
            queued.popleft()
            if head is open_batch:
                open_batch = None
            cutoff = sealed_at + call_of(head.shapes)
            kept = [i for i, a in enumerate(head.arrivals) if a + deadline >= cutoff]
            live = [head.arrivals[i] for i in kept]
            if s.on_curve:
                call = call_of([head.shapes[i] for i in kept])
            expired = len(head.arrivals) - len(live)
            outcome.expired += expired
            outcome.timeouts += expired
            outcome.answers_ms.extend([deadline] * expired)
            busy_until = sealed_at
            if live:
                call_ends.append(sealed_at + turn_ms)
                busy_until += call
                outcome.calls += 1
                outcome.sampled += len(live)
                outcome.busy_ms += call
                turn_ms += TURN_WEIGHT * (call + s.gap_ms - turn_ms)
                for arrived in live:
                    latency = busy_until - arrived + s.path_ms
                    if latency > deadline:
                        outcome.timeouts += 1  # answered after the caller's 504
                        outcome.answers_ms.append(deadline)
                    else:
                        outcome.latencies_ms.append(latency)
                        outcome.answers_ms.append(latency)
            heapq.heapreplace(free_at, busy_until + s.gap_ms)

    now, end = 0.0, s.duration_s * 1000
    mean_gap = 1000 / s.rate_rps
    while True:
        now += rng.expovariate(1.0) * mean_gap
        if now >= end:
            break
        seal_until(now)
        outcome.requests += 1
        shape = s.shapes.draw(shapes_rng) if s.on_curve and s.shapes is not None else None
        if refuses(queued, open_batch is not None, s.gpus, turn_ms, now, deadline, call_ends):
            outcome.rejected += 1
            outcome.answers_ms.append(s.path_ms)
            continue
        if open_batch is None:
            open_batch = _Batch(now)
            queued.append(open_batch)
        open_batch.arrivals.append(now)
        if shape is not None:
            open_batch.shapes.append(shape)
        if len(open_batch.arrivals) >= s.max_batch:
            open_batch = None
    seal_until(math.inf)
    return outcome


def refuses(
    queued: deque[_Batch],
    open_batch_queued: bool,
    gpus: int,
    turn_ms: float,
    now: float,
    deadline: float,
    call_ends: Sequence[float] = (),
) -> bool:
    """Admission, as the aggregator decides it: count the batches queued behind the GPUs
    that opened within a deadline (`queued` is oldest first), not counting the open batch the
    request would join, and apply batching.admission's formula to the full deadline, with
    when the running calls end (`call_ends`, as their seals saw it) when there is a backlog."""
    ahead = len(queued) - (1 if open_batch_queued else 0)
    if ahead < gpus:
        return False  # no backlog (the common case: skip the scan below)
    for batch in queued:  # oldest first: skip those opened over a deadline ago
        if batch.opened_ms >= now - deadline:
            break
        ahead -= 1
    frees = sorted(end - now for end in call_ends)
    return admission.refuses(ahead, gpus, turn_ms, deadline, frees)


@dataclass(frozen=True)
class Plan:
    gpus: int
    lower_bound: int
    outcome: Outcome
    tried: dict[int, Outcome]


def fewest_gpus(base: Scenario, percentile: float = 99.0, limit: int = 100_000) -> Plan:
    """The fewest GPUs whose simulated `percentile` latency (failures counting as late) is
    within the deadline, searching upward from the analytic lower bound."""
    lower = base.lower_bound_gpus
    tried: dict[int, Outcome] = {}
    gpus = lower
    while gpus <= limit:
        result = simulate(replace(base, gpus=gpus))
        tried[gpus] = result
        if result.percentile_ms(percentile) <= base.deadline_ms:
            return Plan(gpus, lower, result, tried)
        # Far from the goal, step by the share still failing; near it, one at a time.
        missing = (percentile / 100 - result.ok_share) * gpus
        gpus += max(1, int(missing * 0.5))
    raise ValueError(f"no GPU count up to {limit} meets p{percentile:g} <= {base.deadline_ms} ms")


def web_nodes(rate_rps: float, cpu_ms_per_request: float, cores: int, utilisation: float) -> int:
    """Web nodes of `cores` cores kept at `utilisation` that carry `rate_rps`."""
    return max(1, math.ceil(rate_rps * cpu_ms_per_request / 1000 / (cores * utilisation)))


# A shard is planned at this share of its measured ceiling: room for bursts and for a node
# that is slower than the one measured.
SHARD_UTILISATION = 0.5


def redis_shards(rate_rps: float, shard_rps: float, utilisation: float = SHARD_UTILISATION) -> int:
    """Shards (SAMPLING_SHARDS, each one Redis master's core) that carry `rate_rps` with each
    at `utilisation` of one shard's ceiling `shard_rps`."""
    return max(1, math.ceil(rate_rps / (shard_rps * utilisation)))
