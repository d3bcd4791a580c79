"""Priority tiers under overload: one simulated GPU offered 150% of its limit by three tiers.

    .venv/bin/python -m bench tiers [--rounds 3] [--seconds 20] [--load 1.5]

Starts its own Redis (embedded unless REDIS_URL is set), one Celery worker with the simulated
sampler and gunicorn (2 processes), makes one API key per tier as an operator does
(`manage.py createapikey NAME --tier T`), then offers open-loop Poisson traffic (the harness's)
at `--load` times the GPU's limit, each request's key drawn at random: 30% enterprise, 30%
plus, 40% free. The limit is what the GPU can serve: a full batch per call,
SAMPLING_MAX_BATCH_SIZE x 1000 / SIMULATED_BATCH_MS requests per second.

The call is shorter and the batch smaller than the seed problem's (50 ms and 10 by default,
not 100 ms and 100): the benchmark measures which batch a free GPU takes and whom admission
refuses, not how many requests the front end carries (bench frontend), so its traffic must
leave the machine's two cores room, client and service alike: 300 requests/s do on the
slower of this project's 2-core machines, where a request costs the front end 2.3 ms of CPU,
and 750 (batches of 25) saturate it and measure only the queueing for a core (the client's
send lag, printed with each round, says so). A tier's batch takes as long to fill, in calls,
whatever the batch size: 0.45 of the limit fills a batch in 2.2 calls. Enterprise's p99
budget (300 ms) must hold that fill time, one running call and its own call, which 50 ms
calls allow and 100 ms calls do not (a batch holds one tier only). SIMULATED_BATCH_MS and
SAMPLING_MAX_BATCH_SIZE in the environment change both.

Prints, per round and as medians over the rounds, per tier: offered and served requests/s,
goodput as a share of the tier's offered load, p50 and p99 latency of its completions, its
503s with their p99 latency, and its 504s; the total goodput as a share of the limit; the
turns the GPU took (a worker's own time between two calls makes a turn longer than a call)
and what they could have carried at full batches; and the client's send lag (p99).

Each round is preceded by a baseline on the same stack at the same load, with every request
of one tier: one lane, so every turn takes a full batch and admission has no tier to weigh.
What it serves is the GPU's limit as this machine measures it (the nominal limit less the
worker's time between calls and what the front end's CPU costs), and the tiers' total is
also printed as a share of it: the share of the GPU that priorities cost.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
import uuid

import redis

from batching.access import STARTING_TIERS
from batching.aggregator import BatchAggregator
from batching.outcomes import RequestOutcome
from bench.harness import loadgen
from bench.harness.stack import Stack, make_api_keys, new_queue, simulated_env, simulated_stack
from bench.harness.stats import percentile
from bench.tiers.report import batches, medians, table
from devstack.embedded_redis import redis_url_or_embedded
from workers.samplers.simulated import expected_completion

# The scenario's traffic: tier -> share of the requests.
MIX = {"enterprise": 0.30, "plus": 0.30, "free": 0.40}
# The baseline's: the same requests, all of one tier.
ONE_TIER = {"plus": 1.0}
WARM_UP_S = 3.0


def one_round(
    stack: Stack,
    keys: dict[str, str],
    rate_rps: float,
    seconds: float,
    seed: int,
    mix: dict[str, float] = MIX,
) -> dict[str, dict[str, float]]:
    rng = random.Random(seed)
    tiers = list(mix)
    count = int(rate_rps * seconds * 1.5) + 100  # more than the schedule can hold
    tier_of = rng.choices(tiers, weights=[mix[tier] for tier in tiers], k=count)
    run_id = uuid.uuid4().hex[:6]
    results = loadgen.run(
        "127.0.0.1",
        stack.port,
        "/sample",
        rate_rps,
        seconds,
        lambda i: f"tier {run_id} {i}",
        expected_completion,
        seed=seed,
        headers=lambda i: {"Authorization": f"Bearer {keys[tier_of[i]]}"},
    )
    rows: dict[str, dict[str, float]] = {}
    lag_p99_ms = percentile(results.send_lag_ms, 99)
    for tier in [*tiers, "total"]:
        picked = [i for i in range(results.sent) if tier in ("total", tier_of[i])]
        outcomes = [results.outcomes[i] for i in picked]
        latencies = [results.latencies_ms[i] for i in picked]

        def of(outcome: str, got: list[str] = outcomes, ms: list[float] = latencies) -> list[float]:
            return [latency for latency, o in zip(ms, got, strict=True) if o == outcome]

        ok, refused, late = (
            of(RequestOutcome.OK),
            of(RequestOutcome.REJECTED),
            of(RequestOutcome.TIMEOUT),
        )
        rows[tier] = {
            "offered_rps": len(picked) / seconds,
            "served_rps": len(ok) / seconds,
            "goodput_pct": 100 * len(ok) / len(picked) if picked else float("nan"),
            "p50_ms": percentile(ok, 50),
            "p99_ms": percentile(ok, 99),
            "rejected": len(refused),
            "rejected_p99_ms": percentile(refused, 99),
            "timeouts": len(late),
            "other": len(picked) - len(ok) - len(refused) - len(late),
        }
    rows["total"]["send_lag_p99_ms"] = lag_p99_ms
    return rows


def run(
    redis_url: str,
    rounds_wanted: int,
    seconds: float,
    load: float,
    batch_ms: int,
    max_batch: int,
    deadline_ms: int,
) -> tuple[list[dict[str, dict[str, float]]], list[float]]:
    """The rounds' rows, and each round's one-tier goodput (req/s), on a stack of its own
    with one simulated GPU."""
    limit_rps = max_batch * 1000 / batch_ms
    rate_rps = load * limit_rps
    queue = new_queue("bench-tiers")
    env = simulated_env(
        redis_url, queue, call_ms=batch_ms, max_batch=max_batch, deadline_ms=deadline_ms,
        log_level=None, SAMPLING_REQUIRE_API_KEY="true",
    )  # fmt: skip
    stack = simulated_stack(env, [None])
    rounds: list[dict[str, dict[str, float]]] = []
    one_tier: list[float] = []  # served req/s of each round's one-tier run
    try:
        stack.start(timeout_s=120)
        keys = make_api_keys(stack, {f"bench-{tier}": ["--tier", tier] for tier in MIX})
        keys = {tier: keys[f"bench-{tier}"] for tier in MIX}
        print(
            f"1 simulated GPU: {batch_ms} ms a call, batches of {max_batch}, deadline "
            f"{deadline_ms} ms; limit {limit_rps:.0f} req/s, offered {rate_rps:.0f} req/s "
            f"({load:.0%}): {', '.join(f'{t} {s:.0%}' for t, s in MIX.items())}",
            flush=True,
        )
        one_round(stack, keys, limit_rps * 0.5, WARM_UP_S, seed=999)
        client = redis.Redis.from_url(redis_url)
        aggregator = BatchAggregator(client, queue)
        priorities = {tier: STARTING_TIERS[tier] for tier in MIX}
        for index in range(rounds_wanted):
            # The GPU's limit as this machine measures it: the same load, the same stack, one
            # tier only (one lane: every turn a full batch, nothing to choose between), just
            # before the tiers' round. What the tiers serve below it is what priorities cost.
            alone = one_round(stack, keys, rate_rps, seconds, seed=index + 1, mix=ONE_TIER)
            one_tier.append(alone["total"]["served_rps"])
            print(
                f"\nround {index + 1}, one tier alone: "
                f"{alone['total']['served_rps']:.0f} req/s served",
                flush=True,
            )
            time.sleep(1.0)
            client.delete(aggregator.keys.batch_log)
            rows = one_round(stack, keys, rate_rps, seconds, seed=index + 1)
            rounds.append(rows)
            print(f"round {index + 1}\n{table(rows, limit_rps, one_tier[-1])}", flush=True)
            print(
                batches(aggregator, priorities, max_batch, rows["total"]["served_rps"]),
                flush=True,
            )
            time.sleep(1.0)
    finally:
        stack.stop()
    return rounds, one_tier


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--load", type=float, default=1.5, help="offered load / the limit")


def main(args: argparse.Namespace) -> None:
    batch_ms = int(os.environ.get("SIMULATED_BATCH_MS", "50"))
    max_batch = int(os.environ.get("SAMPLING_MAX_BATCH_SIZE", "10"))
    deadline_ms = int(os.environ.get("SAMPLING_DEADLINE_MS", "500"))
    limit_rps = max_batch * 1000 / batch_ms

    with redis_url_or_embedded() as redis_url:
        rounds, one_tier = run(
            redis_url, args.rounds, args.seconds, args.load, batch_ms, max_batch, deadline_ms
        )
    if len(rounds) > 1:
        summary = table(medians(rounds), limit_rps, statistics.median(one_tier))
        print(f"\nmedians over {len(rounds)} rounds\n{summary}")
