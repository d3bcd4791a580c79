"""One shard's stepping: a valkey-server, the client processes and the sealer, and each
step's figures (bench.shard_ceiling)."""

from __future__ import annotations

import contextlib
import multiprocessing
import queue as queue_module
import threading
import time
import uuid
from dataclasses import dataclass
from multiprocessing.context import SpawnProcess
from multiprocessing.queues import Queue
from typing import Any

import redis

from batching.admission import AdmissionInputs
from batching.aggregator import BatchAggregator
from bench.harness.procstat import redis_cpu
from bench.harness.stats import percentile
from bench.shard_ceiling.clients import DEADLINE_MS, MAX_BATCH, Share, Step, client_process
from devstack.embedded_redis import EmbeddedRedis, valkey_binary

SEAL_EVERY_S = 0.010
INPUTS = AdmissionInputs(workers=1000, turn_ms=1)  # admission never refuses
P99_LIMIT_MS = 5.0
ACHIEVED_LIMIT = 0.9  # of the offered rate
RATES = [1000, 2000, 4000, 6000, 8000, 10000, 14000, 18000, 22000, 26000]
NOT_REACHED = "not reached: every offered rate passed"
START_DELAY_S = 0.5  # from sending a step to its start, for every client to be waiting


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
        cpu_before, main_before = redis_cpu(client)
        wall_before = time.perf_counter()
        sleep_until(start_at + self.seconds)
        cpu_after, main_after = redis_cpu(client)
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
