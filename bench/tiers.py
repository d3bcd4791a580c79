"""Priority tiers under overload: one simulated GPU offered 150% of its limit by three tiers.

    .venv/bin/python -m bench.tiers [--rounds 3] [--seconds 20] [--load 1.5]

Starts its own Redis (embedded unless REDIS_URL is set), one Celery worker with the simulated
sampler and gunicorn (2 processes), makes one API key per tier as an operator does
(`manage.py createapikey NAME --tier T`), then offers open-loop Poisson traffic (bench.loadgen)
at `--load` times the GPU's limit, each request's key drawn at random: 30% enterprise, 30%
plus, 40% free. The limit is what the GPU can serve: a full batch per call,
SAMPLING_MAX_BATCH_SIZE x 1000 / SIMULATED_BATCH_MS requests per second.

The call is shorter and the batch smaller than the seed problem's (50 ms and 10 by default,
not 100 ms and 100): the benchmark measures which batch a free GPU takes and whom admission
refuses, not how many requests the front end carries (bench.frontend), so its traffic must
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
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis

from batching.access import POLL_INTERVAL_S, STARTING_TIERS
from batching.aggregator import BatchAggregator
from batching.outcomes import RequestOutcome
from bench import loadgen
from inference_site.lib.embedded_redis import redis_url_or_embedded
from inference_site.lib.stack import ROOT, Stack
from workers.samplers.simulated import expected_completion

# The scenario's traffic: tier -> share of the requests.
MIX = {"enterprise": 0.30, "plus": 0.30, "free": 0.40}
# The baseline's: the same requests, all of one tier.
ONE_TIER = {"plus": 1.0}
WARM_UP_S = 3.0


def make_keys(stack: Stack) -> dict[str, str]:
    """One key per tier, made with the management command in the stack's own database (the
    web processes republish its keys), once every web process has them."""
    env, manage = stack.environment(), [sys.executable, str(ROOT / "manage.py")]
    keys = {}
    for tier in MIX:
        made = subprocess.run(
            [*manage, "createapikey", f"bench-{tier}", "--tier", tier],
            env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        keys[tier] = made.stdout.strip().splitlines()[-1]
    time.sleep(2 * POLL_INTERVAL_S + 0.5)
    return keys


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
    lag_p99_ms = loadgen.percentile(results.send_lag_ms, 99)
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
            "p50_ms": loadgen.percentile(ok, 50),
            "p99_ms": loadgen.percentile(ok, 99),
            "rejected": len(refused),
            "rejected_p99_ms": loadgen.percentile(refused, 99),
            "timeouts": len(late),
            "other": len(picked) - len(ok) - len(refused) - len(late),
        }
    rows["total"]["send_lag_p99_ms"] = lag_p99_ms
    return rows


def table(
    rows: dict[str, dict[str, float]], limit_rps: float, one_tier_rps: float | None = None
) -> str:
    lines = [
        "| tier | offered req/s | served req/s | goodput (of offered) | p50 ms | p99 ms "
        "| 503s | 503 p99 ms | 504s | other |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for tier, row in rows.items():
        lines.append(
            f"| {tier} | {row['offered_rps']:.0f} | {row['served_rps']:.0f} "
            f"| {row['goodput_pct']:.1f}% | {row['p50_ms']:.0f} | {row['p99_ms']:.0f} "
            f"| {row['rejected']:.0f} | {row['rejected_p99_ms']:.0f} | {row['timeouts']:.0f} "
            f"| {row['other']:.0f} |"
        )
    total = rows["total"]["served_rps"]
    lines.append(
        f"\ntotal goodput: {total:.0f} req/s = {100 * total / limit_rps:.1f}% of the limit; "
        f"the client's send lag p99 {rows['total']['send_lag_p99_ms']:.1f} ms"
    )
    if one_tier_rps:
        lines.append(
            f"one tier alone, the same load: {one_tier_rps:.0f} req/s = "
            f"{100 * one_tier_rps / limit_rps:.1f}% of the limit; the tiers' total is "
            f"{100 * total / one_tier_rps:.1f}% of it"
        )
    return "\n".join(lines)


def batches(
    aggregator: BatchAggregator, priorities: dict[str, int], max_batch: int, served_rps: float
) -> str:
    """Per tier, the batches the round ran (the worker's batch log): how many, their mean
    size, and how many of their items were sampled (not dropped at their deadline); the calls
    they took, the places of those calls left empty (a part-full batch, or members past their
    deadline), and the seals that found every member past its deadline (no call); how often
    the GPU took a turn, what full batches would have carried, and the share of that served."""
    records = [json.loads(raw) for raw in aggregator.batch_log.recent()]
    parts = []
    for tier, lane in priorities.items():
        mine = [record for record in records if record.get("lane") == lane]
        if mine:
            size = statistics.mean(record["size"] for record in mine)
            sampled = statistics.mean(record["sampled"] for record in mine)
            called = [record for record in mine if record["sampled"]]
            empty = sum(max_batch - record["sampled"] for record in called)
            parts.append(
                f"{tier}: {len(mine)} batches of {size:.1f} ({sampled:.1f} sampled), "
                f"{len(called)} calls with {empty} places empty, "
                f"{len(mine) - len(called)} seals without a call"
            )
    sealed_at = sorted(record["sealed_at_ms"] for record in records)
    gaps = [later - earlier for earlier, later in itertools.pairwise(sealed_at)]
    if gaps:
        turn_ms = statistics.median(gaps)
        full_rps = max_batch * 1000 / turn_ms
        parts.append(
            f"a turn every {turn_ms:.1f} ms (median): {full_rps:.0f} req/s at full batches, "
            f"{100 * served_rps / full_rps:.1f}% of it served"
        )
    return "batches: " + "; ".join(parts)


def medians(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {
        tier: {name: statistics.median(r[tier][name] for r in rounds) for name in rounds[0][tier]}
        for tier in rounds[0]
    }


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
    queue = f"bench-tiers-{uuid.uuid4().hex[:6]}"
    stack = Stack(
        env={
            "REDIS_URL": redis_url,
            "SAMPLER": "simulated",
            "SAMPLING_QUEUE": queue,
            "SIMULATED_BATCH_MS": str(batch_ms),
            "SAMPLING_MAX_BATCH_SIZE": str(max_batch),
            "SAMPLING_DEADLINE_MS": str(deadline_ms),
            "SAMPLING_REQUIRE_API_KEY": "true",
        },
        gpus=[None],
        web_processes=2,
        log_dir=Path("/tmp") / f"bench-{queue}",
        own_database=True,
    )
    rounds: list[dict[str, dict[str, float]]] = []
    one_tier: list[float] = []  # served req/s of each round's one-tier run
    try:
        stack.start(timeout_s=120)
        keys = make_keys(stack)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--load", type=float, default=1.5, help="offered load / the limit")
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
