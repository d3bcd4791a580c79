"""One simulated GPU under open-loop load up to twice its limit: is every answer on time?

    .venv/bin/python -m bench overload                      # this tree, loads 50 to 200%
    .venv/bin/python -m bench overload --against 24e1407    # the same for an older commit too
    .venv/bin/python -m bench overload --spin 1             # on a slower machine
    .venv/bin/python -m bench overload --cost h100-graphs-135m --loads 90

One simulated GPU (100 ms a call, batches of 100: a limit of 1,000 req/s; `--cost` prices calls
on a cost profile instead) behind gunicorn with 2 gevent processes, and the harness's load
generator offering Poisson arrivals on the same 2 cores (as in `python -m bench compare`).
First the node's own capacity: the highest rate this tree serves in full (every answer a 200,
the p99 within the deadline), found by halving with short runs; under the GPU's limit where the
web tier's CPU binds. Each stack first serves 30% of the limit for 5 s, not counted (a fresh
stack's first second is not a running node's). At each load the client counts every answer from
its intended send time: goodput, the p99 and p99.9 of every answer whatever its status, the
shares of 200, 503, 504 and of anything else (another status, a connection error, no answer in
2 s), and each 200's body is checked against the simulated completion of its prompt; the web
processes' and the client's CPU per request, and the most connections seen waiting in the
kernel's accept queue (sampled every 100 ms). Requests carry `X-Request-Start` as behind nginx
(`--stamp`). With `--against`, the older commit runs in a worktree of its own, the two trees
taking turns each round; medians are reported. `--spin N` keeps N cores busy with spinning
processes at normal priority all along, as a slower or shared machine. Ends with the overload
goals checked on this tree's figures.
"""

from __future__ import annotations

import argparse
import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from batching.call_cost import CONTRACT
from batching.outcomes import RequestOutcome
from bench.harness import loadgen
from bench.harness.capacity import Probe, highest_rate
from bench.harness.costs import Calls
from bench.harness.procstat import accept_queue, cpu_seconds
from bench.harness.spinner import spinning
from bench.harness.stack import Stack, new_queue, simulated_env, simulated_stack
from bench.harness.stats import percentile
from bench.harness.trees import Tree, in_turn, trees
from bench.overload.goals import DEADLINE_MS, line, table, verdict
from devstack.embedded_redis import EmbeddedRedis

CALL_MS = 100
MAX_BATCH = 100
LOADS = [50, 90, 100, 150, 200]
CLIENT_TIMEOUT_S = 2.0
PROBE_S = 5.0  # a capacity probe's run
# Each stack first serves this share of the GPU's limit for PROBE_S, not counted: a fresh
# stack's first second (its processes' first requests, a worker's unknown turn) ended 504s
# and 503s that a running node does not see.
WARM_SHARE = 0.3


@dataclass(frozen=True)
class Case:
    """A tree measured one way: its name in the report, and whether its requests carry
    X-Request-Start, as behind a proxy."""

    name: str
    tree: Tree
    stamp: bool


def measure(
    stack: Stack, calls: Calls, rate: float, duration_s: float, tag: str, stamp: bool = False
) -> dict[str, float]:
    assert stack.web is not None
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
        lambda i: f"overload {tag} {i}: the prompt",
        calls.expected(),
        client_timeout_s=CLIENT_TIMEOUT_S,
        seed=int(rate),
        stamp=stamp,
    )
    web_cpu_s = cpu_seconds(stack.web.pid) - cpu_before
    done.set()
    watcher.join()
    return {
        "load": round(rate * 100 / calls.limit_rps()),
        "offered": rate,
        "goodput": results.goodput_rps,
        "of limit": results.goodput_rps / calls.limit_rps(),
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


@contextlib.contextmanager
def started(tree: Tree, redis_url: str, calls: Calls) -> Iterator[Stack]:
    env = simulated_env(
        redis_url, new_queue("bench-overload"), call_ms=CALL_MS, max_batch=MAX_BATCH,
        deadline_ms=DEADLINE_MS, **calls.env(),
    )  # fmt: skip
    stack = simulated_stack(env, [0], root=tree.root)
    try:
        stack.start(timeout_s=120)
        yield stack
    finally:
        stack.stop()


def run_case(
    case: Case, redis_url: str, calls: Calls, loads: list[int], duration_s: float
) -> list[dict]:
    rows = []
    with started(case.tree, redis_url, calls) as stack:
        measure(stack, calls, calls.limit_rps() * WARM_SHARE, PROBE_S, "warm", case.stamp)
        time.sleep(1.0)
        for load in loads:
            rate = calls.limit_rps() * load / 100
            row = measure(stack, calls, rate, duration_s, uuid.uuid4().hex[:6], case.stamp)
            rows.append(row)
            print(f"  {case.name:>8} {line(row)}", flush=True)
            time.sleep(1.0)  # the last answers and 504s of this level leave before the next
    return rows


def node_capacity(tree: Tree, redis_url: str, calls: Calls, stamp: bool) -> float:
    """The highest rate `tree` serves in full on this node, up to the GPU's limit."""

    def probe(rate: float) -> Probe:
        row = measure(stack, calls, rate, PROBE_S, uuid.uuid4().hex[:6], stamp)
        print(f"  capacity probe {line(row)}", flush=True)
        time.sleep(1.0)
        return Probe(rate, row["200"] == 1.0 and row["wrong"] == 0, row["p99"])

    with started(tree, redis_url, calls) as stack:
        probe(calls.limit_rps() * WARM_SHARE)  # warm, as run_case
        rate, _ = highest_rate(probe, calls.limit_rps() * 0.2, calls.limit_rps(), DEADLINE_MS)
    return rate


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
    parser.add_argument("--cost", default=CONTRACT, help="a cost profile, default contract")
    parser.add_argument("--spin", type=int, default=0, help="cores kept busy, default 0")
    parser.add_argument("--no-capacity", action="store_true", help="skip the node's capacity")


def cases(versions: list[Tree], stamp: str) -> list[Case]:
    """This tree once per stamp setting; an older one with the last of them."""
    stamps = {"on": [True], "off": [False], "both": [False, True]}[stamp]
    this = [Case("this" + ("+stamp" if on else ""), versions[-1], on) for on in stamps]
    return [Case(tree.name, tree, stamps[-1]) for tree in versions[:-1]] + this


def main(args: argparse.Namespace) -> None:
    calls = Calls(args.cost, CALL_MS, MAX_BATCH)
    print(
        f"1 simulated GPU: {calls.describe()}, batches of {MAX_BATCH} (limit "
        f"{calls.limit_rps():.0f} req/s), deadline {DEADLINE_MS} ms, 2 gevent web processes; "
        f"{args.seconds:g} s a load; {args.spin} core(s) kept busy"
    )
    figures: dict[str, dict[int, list[dict[str, float]]]] = {}
    capacity = None
    with contextlib.ExitStack() as resources:
        measured = cases(trees(resources, args.against), args.stamp)
        server = EmbeddedRedis().start()
        resources.callback(server.stop)
        resources.enter_context(spinning(args.spin))
        if not args.no_capacity:
            capacity = node_capacity(measured[-1].tree, server.url, calls, measured[-1].stamp)
            print(f"the node's capacity: {capacity:.0f} req/s (the GPU's limit "
                  f"{calls.limit_rps():.0f})")  # fmt: skip
        for round_index in range(args.rounds):
            print(f"round {round_index + 1}")
            for case in in_turn(measured, round_index):
                for row in run_case(case, server.url, calls, args.loads, args.seconds):
                    figures.setdefault(case.name, {}).setdefault(int(row["load"]), []).append(row)
    print(f"\nMedians of {args.rounds} round(s):\n")
    print(table(figures))
    if capacity is not None:
        print(f"\nThe node's capacity: {capacity:.0f} req/s; the GPU's limit "
              f"{calls.limit_rps():.0f} req/s")  # fmt: skip
    print()
    for name, by_load in figures.items():
        for said in verdict(by_load, calls.limit_rps(), capacity):
            print(f"{name} {said}")
