"""One simulated GPU under open-loop load up to twice its limit: is every answer on time?

    .venv/bin/python -m bench overload                      # this tree, loads 50 to 200%
    .venv/bin/python -m bench overload --against 24e1407    # the same for an older commit too

One simulated GPU (100 ms a call, batches of 100: a limit of 1,000 req/s) behind gunicorn with
2 gevent processes, and the harness's load generator offering Poisson arrivals on the same 2
cores (as in `python -m bench compare`). At each load the client counts every answer from its
intended send time: goodput, the p99 and p99.9 of every answer whatever its status, the shares
of 200, 503, 504 and of anything else (another status, a connection error, no answer in 2 s),
and each 200's body is checked against the simulated completion of its prompt; the web
processes' and the client's CPU per request, and the most connections seen waiting in the
kernel's accept queue (sampled every 100 ms). Requests carry `X-Request-Start` as behind nginx
(`--stamp`). With `--against`, the older commit runs in a worktree of its own, the two trees
taking turns each round; medians are reported. Ends with the overload goals of the issue
checked on this tree's figures.
"""

from __future__ import annotations

import argparse
import contextlib
import threading
import time
import uuid
from dataclasses import dataclass

from batching.outcomes import RequestOutcome
from bench.harness import loadgen
from bench.harness.procstat import accept_queue, cpu_seconds
from bench.harness.report import markdown_table
from bench.harness.stack import Stack, new_queue, simulated_env, simulated_stack
from bench.harness.stats import median_of_rounds, percentile
from bench.harness.trees import Tree, in_turn, trees
from inference_site.lib.embedded_redis import EmbeddedRedis
from workers.samplers.simulated import expected_completion

CALL_MS = 100
MAX_BATCH = 100
DEADLINE_MS = 500
LIMIT_RPS = MAX_BATCH * 1000 / CALL_MS
LOADS = [50, 90, 100, 150, 200]
CLIENT_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Case:
    """A tree measured one way: its name in the report, and whether its requests carry
    X-Request-Start, as behind a proxy."""

    name: str
    tree: Tree
    stamp: bool


def measure(
    stack: Stack, load: int, duration_s: float, tag: str, stamp: bool = False
) -> dict[str, float]:
    assert stack.web is not None
    rate = LIMIT_RPS * load / 100
    cpu_before = cpu_seconds(stack.web.pid)
    done, queued = threading.Event(), [0]

    def watch_accept_queue() -> None:
        while not done.wait(0.1):
            queued[0] = max(queued[0], accept_queue(stack.port))

    watcher = threading.Thread(target=watch_accept_queue, daemon=True)
    watcher.start()
    results = loadgen.run(
        "127.0.0.1",
        stack.port,
        "/sample",
        rate,
        duration_s,
        lambda i: f"overload {tag} {load} {i}: the prompt",
        expected_completion,
        client_timeout_s=CLIENT_TIMEOUT_S,
        seed=load,
        stamp=stamp,
    )
    web_cpu_s = cpu_seconds(stack.web.pid) - cpu_before
    done.set()
    watcher.join()
    return {
        "load": load,
        "offered": rate,
        "goodput": results.goodput_rps,
        "of limit": results.goodput_rps / LIMIT_RPS,
        "p50": results.percentile_ms(50),
        "p99": results.percentile_ms(99),
        "p99.9": results.percentile_ms(99.9),
        "max": max(results.latencies_ms, default=float("nan")),
        "200": results.share(RequestOutcome.OK),
        "503": results.share(RequestOutcome.REJECTED),
        "503 p99": results.percentile_ms(99, RequestOutcome.REJECTED),
        "504": results.share(RequestOutcome.TIMEOUT),
        "other": results.share(loadgen.OTHER),
        "wrong": results.count(loadgen.WRONG),
        "web cpu": web_cpu_s / max(1, results.sent) * 1000,
        "send lag p99": percentile(results.send_lag_ms, 99),
        "client cpu": results.client_cpu_s / max(1, results.sent) * 1000,
        "accept queue": queued[0],
    }


def run_case(case: Case, redis_url: str, loads: list[int], duration_s: float) -> list[dict]:
    queue = new_queue("bench-overload")
    env = simulated_env(
        redis_url, queue, call_ms=CALL_MS, max_batch=MAX_BATCH, deadline_ms=DEADLINE_MS
    )
    stack = simulated_stack(env, [0], root=case.tree.root)
    rows = []
    try:
        stack.start(timeout_s=120)
        for load in loads:
            row = measure(stack, load, duration_s, uuid.uuid4().hex[:6], case.stamp)
            rows.append(row)
            print(f"  {case.name:>8} {line(row)}", flush=True)
            time.sleep(1.0)  # the last answers and 504s of this level leave before the next
    finally:
        stack.stop()
    return rows


def line(row: dict[str, float]) -> str:
    return (
        f"{row['offered']:6.0f} req/s: goodput {row['goodput']:6.1f} ({row['of limit']:6.1%})"
        f"  p99/p99.9/max {row['p99']:5.0f}/{row['p99.9']:5.0f}/{row['max']:5.0f} ms"
        f"  200 {row['200']:5.1%} 503 {row['503']:5.1%} 504 {row['504']:5.1%}"
        f" other {row['other']:5.1%} wrong {row['wrong']:.0f}  web CPU {row['web cpu']:.2f} ms"
        f"  send lag p99 {row['send lag p99']:.0f} ms  client CPU {row['client cpu']:.2f} ms"
        f"  accept queue max {row['accept queue']:.0f}"
    )


COLUMNS = [
    ("offered", "offered req/s", "{:.0f}"),
    ("goodput", "goodput req/s", "{:.0f}"),
    ("of limit", "of the limit", "{:.1%}"),
    ("p50", "p50 ms", "{:.0f}"),
    ("p99", "p99 ms", "{:.0f}"),
    ("p99.9", "p99.9 ms", "{:.0f}"),
    ("max", "max ms", "{:.0f}"),
    ("503", "503", "{:.1%}"),
    ("503 p99", "503 p99 ms", "{:.0f}"),
    ("504", "504", "{:.1%}"),
    ("other", "other", "{:.1%}"),
    ("wrong", "wrong", "{:.0f}"),
    ("web cpu", "web CPU ms/req", "{:.2f}"),
    ("send lag p99", "client lag p99 ms", "{:.0f}"),
    ("client cpu", "client CPU ms/req", "{:.2f}"),
    ("accept queue", "accept queue max", "{:.0f}"),
]


def table(figures: dict[str, dict[int, list[dict[str, float]]]]) -> str:
    rows = [
        [name, *(fmt.format(median_of_rounds(runs)[key]) for key, _, fmt in COLUMNS)]
        for name, by_load in figures.items()
        for runs in by_load.values()
    ]
    return markdown_table(["code", *(title for _, title, _ in COLUMNS)], rows)


def verdict(by_load: dict[int, list[dict[str, float]]]) -> list[str]:
    """The issue's overload goals, on medians."""
    rows = {load: median_of_rounds(runs) for load, runs in by_load.items()}
    best_below = max((row["goodput"] for load, row in rows.items() if load < 150), default=0.0)
    said = []
    goals = ((150, 0.90, 0.95, 50), (200, 0.85, None, 100))
    for load, of_limit, of_best, late_ms in goals:
        row = rows.get(load)
        if row is None:
            continue
        checks = [
            (f"goodput >= {of_limit:.0%} of the limit", row["of limit"] >= of_limit),
            (f"p99.9 <= deadline + {late_ms} ms", row["p99.9"] <= DEADLINE_MS + late_ms),
            ("0 wrong", row["wrong"] == 0),
        ]
        if of_best is not None and best_below:
            share = row["goodput"] / best_below
            checks.append((f"goodput >= {of_best:.0%} of the best below ({share:.1%})",
                           share >= of_best))  # fmt: skip
        shown = "; ".join(f"{text}: {'yes' if ok else 'NO'}" for text, ok in checks)
        said.append(f"{load}%: {shown}")
    return said


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--against", help="a git ref measured the same way, taking turns")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=10.0, help="per load")
    parser.add_argument("--loads", type=int, nargs="+", default=LOADS, help="percent of limit")
    parser.add_argument(
        "--stamp",
        choices=["on", "off", "both"],
        default="on",
        help="requests carry X-Request-Start (their intended send time), as nginx sets it in "
        "front of a node (deploy/); both: this tree is measured with and without",
    )


def cases(versions: list[Tree], stamp: str) -> list[Case]:
    """This tree once per stamp setting; an older one with the last of them."""
    stamps = {"on": [True], "off": [False], "both": [False, True]}[stamp]
    this = [Case("this" + ("+stamp" if on else ""), versions[-1], on) for on in stamps]
    return [Case(tree.name, tree, stamps[-1]) for tree in versions[:-1]] + this


def main(args: argparse.Namespace) -> None:
    print(
        f"1 simulated GPU: {CALL_MS} ms a call, batches of {MAX_BATCH} (limit {LIMIT_RPS:.0f} "
        f"req/s), deadline {DEADLINE_MS} ms, 2 gevent web processes; {args.seconds:g} s a load"
    )
    figures: dict[str, dict[int, list[dict[str, float]]]] = {}
    with contextlib.ExitStack() as resources:
        measured = cases(trees(resources, args.against), args.stamp)
        server = EmbeddedRedis().start()
        resources.callback(server.stop)
        for round_index in range(args.rounds):
            print(f"round {round_index + 1}")
            for case in in_turn(measured, round_index):
                for row in run_case(case, server.url, args.loads, args.seconds):
                    figures.setdefault(case.name, {}).setdefault(int(row["load"]), []).append(row)
    print(f"\nMedians of {args.rounds} round(s):\n")
    print(table(figures))
    print()
    for name, by_load in figures.items():
        for said in verdict(by_load):
            print(f"{name} {said}")
