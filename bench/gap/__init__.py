"""How long a GPU waits for its worker between two calls, and the latencies around a call.

    .venv/bin/python -m bench gap                        # this tree, 3 rounds (~6 minutes)
    .venv/bin/python -m bench gap --against 95c8405      # and an older commit, alternating
    .venv/bin/python -m bench gap --write-costs          # also write planning/costs.json

Every worker runs the simulated sampler (SIMULATED_BATCH_MS a call, 100 ms) wrapped by
bench/shims/gap_sampler.py, which logs when each call starts and ends; the same probe loads in
this tree and in an older checkout (`git worktree`), so both are measured the same way in one
run, rounds alternating between them (the machine is noisy: medians are reported).

Scenarios, one Redis for all:
  drain      40 full batches queued while no worker runs, then one worker drains them, the
             machine otherwise idle: the gap from one call's end to the next call's start,
             and the time from a call's end to its result's publication (seen by a
             subscriber), every one of the 4,000 answers checked;
  saturated  one worker behind 2 web processes, open-loop Poisson load at 120% of its limit
             for a few seconds: the gap, and GPU busy (the calls' time over their span),
             every answer checked;
  lone       two workers at 10% load (Poisson, a tenth of the calls per second they can run:
             at low load each request is its own call): latency of the requests sent while
             fewer requests than workers were in flight, so that a GPU was idle for them;
  single     one worker, one request at a time: latency, and its parts around the call:
             dispatch (the client's send to the call's start) and return (the call's end to
             the client's answer).
Latencies are given over the median call (the sampler's own time), as "+ms".
`--write-costs` stores this tree's figures in planning/costs.json, where the capacity
planner takes its fixed costs from.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from bench.gap.drain import drain
from bench.gap.runs import CALL_MS, Bench
from bench.gap.scenarios import lone, saturated, single
from bench.harness.machine import describe_machine
from bench.harness.report import markdown_table
from bench.harness.stack import ROOT
from bench.harness.stats import median, median_of_rounds
from bench.harness.trees import Tree, in_turn, trees
from devstack.embedded_redis import redis_url_or_embedded

COSTS = ROOT / "planning" / "costs.json"
SCENARIOS: dict[str, Callable[[Bench, Tree], None]] = {
    "drain": drain, "saturated": saturated, "lone": lone, "single": single,
}  # fmt: skip


def table(bench: Bench, versions: list[Tree], scenario: str) -> str:
    rows = [(tree, bench.figures.get((tree.name, scenario), [])) for tree in versions]
    names = next((list(runs[0]) for _, runs in rows if runs), [])
    if not names:
        return ""
    cells = [
        [tree.name, *(f"{value:.2f}" for value in median_of_rounds(runs).values())]
        for tree, runs in rows
        if runs
    ]
    rounds = max(len(runs) for _, runs in rows)
    title = f"### {scenario} (median of {rounds} rounds)"
    return f"{title}\n\n{markdown_table(['code', *names], cells)}\n"


def write_costs(bench: Bench, tree: Tree) -> None:
    def figure(scenario: str, name: str) -> float:
        return round(median(r[name] for r in bench.figures[(tree.name, scenario)]), 2)

    costs = {
        "gap_ms": figure("saturated", "gap_p50"),
        "dispatch_ms": figure("single", "dispatch_p50"),
        "path_ms": figure("single", "return_p50"),
        "measured": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": describe_machine(),
        "command": "python -m bench gap --write-costs",
        "rounds": bench.rounds,
    }
    COSTS.write_text(json.dumps(costs, indent=2) + "\n")
    print(f"wrote {COSTS.relative_to(ROOT)}: {costs}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--against", help="a git ref to measure in the same run, alternating")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--saturated-seconds", type=float, default=5.0)
    parser.add_argument("--lone-seconds", type=float, default=60.0)
    parser.add_argument("--single-requests", type=int, default=60)
    parser.add_argument("--write-costs", action="store_true", help="write planning/costs.json")


def main(args: argparse.Namespace) -> None:
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="bench-gap-"))
    with contextlib.ExitStack() as resources:
        redis_url = resources.enter_context(redis_url_or_embedded())
        versions = trees(resources, args.against)
        bench = Bench(
            redis_url, args.rounds, args.saturated_seconds, args.lone_seconds,
            args.single_requests, work,
        )  # fmt: skip
        for round_index in range(args.rounds):
            print(f"round {round_index + 1}/{args.rounds}", flush=True)
            for scenario in args.scenarios:
                for tree in in_turn(versions, round_index):
                    SCENARIOS[scenario](bench, tree)
    print(f"\n{describe_machine()}; call {CALL_MS} ms; {time.monotonic() - started:.0f} s\n")
    for scenario in args.scenarios:
        print(table(bench, versions, scenario))
    if args.write_costs:
        write_costs(bench, versions[-1])
    shutil.rmtree(work, ignore_errors=True)
