"""The front-end benchmark's four parts, each a list of (measure, value) rows (bench.frontend)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import gevent

from bench.frontend.client import COMPLETIONS, closed_loop, one
from bench.harness.procstat import cpu_seconds
from bench.harness.stack import Stack, new_queue, simulated_env, simulated_stack
from bench.harness.stalled import StalledWorker
from bench.harness.stats import percentile
from workers.samplers.simulated import expected_completion

REFUSED = "/sample refused"  # part 2's name for a /sample that waited past its deadline

Rows = list[tuple[str, str]]


@dataclass
class Stacks:
    """The stacks of one run on one Redis, each on a queue of its own; all stopped at the end."""

    redis_url: str
    started: list[Stack] = field(default_factory=list)

    def start(self, label: str, gpus: list[int | None], **env: str) -> Stack:
        settings = simulated_env(self.redis_url, new_queue(f"bench-{label}"), log_level=None)
        stack = simulated_stack({**settings, **env}, gpus)
        self.started.append(stack)
        return stack.start(timeout_s=120)

    def stop(self) -> None:
        for stack in self.started:
            stack.stop()


def single_latency(service: Stack, sequential: int, batch_ms: int) -> Rows:
    """1. Single-request latency, sequential requests."""
    latencies = []
    for i in range(sequential):
        prompt = f"single {i}"
        status, body, seconds = one(service.port, "/sample", prompt.encode())
        assert (status, body) == (200, expected_completion(prompt))
        latencies.append(seconds * 1000)
    p50 = statistics.median(latencies)
    return [
        ("single request latency p50 (ms)", f"{p50:.1f}"),
        ("single request latency p95 (ms)", f"{percentile(latencies, 95):.1f}"),
        ("p50 minus SIMULATED_BATCH_MS (ms)", f"{p50 - batch_ms:+.1f}"),
    ]


def cpu_per_request(service: Stack, rounds: int, cpu_requests: int) -> Rows:
    """2. Front-end CPU per request: the full path, a bare view, the OpenAI-compatible
    endpoint (one prompt) and a /sample refused as late (its X-Request-Start 5 s old: a
    `503` before any Redis call, what an overloaded node pays for each request it cannot
    serve), alternating rounds."""
    assert service.web is not None
    paths = ("/healthz", "/sample", COMPLETIONS, REFUSED)
    per_request: dict[str, list[float]] = {path: [] for path in paths}
    rates: dict[str, list[float]] = {path: [] for path in paths}
    for _ in range(rounds):
        for path in paths:
            before = cpu_seconds(service.web.pid)
            if path == REFUSED:
                late = {"X-Request-Start": f"t={time.time() - 5:.6f}"}
                wall = closed_loop(service.port, "/sample", cpu_requests, 50, True, late, 503)
            else:
                wall = closed_loop(service.port, path, cpu_requests, 50, check=True)
            used = cpu_seconds(service.web.pid) - before
            per_request[path].append(used / cpu_requests * 1000)
            rates[path].append(cpu_requests / wall)
    full = statistics.median(per_request["/sample"])
    bare = statistics.median(per_request["/healthz"])
    api = statistics.median(per_request[COMPLETIONS])
    refused = statistics.median(per_request[REFUSED])
    return [
        ("front-end CPU per request, /sample (ms)", f"{full:.2f}"),
        ("front-end CPU per request, bare view /healthz (ms)", f"{bare:.2f}"),
        ("ratio full path / bare view", f"{full / bare:.2f}"),
        (f"front-end CPU per request, {COMPLETIONS} one prompt (ms)", f"{api:.2f}"),
        (f"ratio {COMPLETIONS} / /sample", f"{api / full:.2f}"),
        (
            "  (/sample throughput in that test, req/s)",
            f"{statistics.median(rates['/sample']):.0f}",
        ),
        ("front-end CPU per request, /sample refused late, 503 (ms)", f"{refused:.2f}"),
        ("ratio refused / served /sample", f"{refused / full:.2f}"),
    ]


def deadline_accuracy(stacks: Stacks, sequential: int, deadline_ms: int) -> Rows:
    """3. 504 latency minus the deadline: sequential requests on a queue whose one worker is
    stalled (it heartbeats, takes no batch)."""
    idle = stacks.start("idle", [])
    errors = []
    with StalledWorker(stacks.redis_url, idle.env["SAMPLING_QUEUE"]):
        one(idle.port, "/sample", b"warm-up", 60)
        for i in range(sequential // 2):
            status, _, seconds = one(idle.port, "/sample", f"alone {i}".encode(), 60)
            assert status == 504, status
            errors.append((seconds - deadline_ms / 1000) * 1000)
    idle.stop()
    shown = f"{percentile(errors, 50):.1f} / {percentile(errors, 99):.1f} / {max(errors):.1f}"
    return [("504 minus deadline, sequential, p50 / p99 / max (ms)", shown)]


HOLD_DEADLINE_MS = 3000
WORKER_CLASSES = {
    "gevent": {},
    "gthread 64 threads": {"GUNICORN_CMD_ARGS": "--worker-class gthread --threads 64"},
}


def simultaneous_waits(stacks: Stacks, waits: int) -> Rows:
    """4. Simultaneous waits one node (2 processes) holds, its worker stalled: requests
    arrive over 1.5 s and wait for a 3 s deadline, so all of them wait at once; each should
    get its 504 at the deadline."""
    rows = []
    for worker_class, extra in WORKER_CLASSES.items():
        idle = stacks.start("hold", [], SAMPLING_DEADLINE_MS=str(HOLD_DEADLINE_MS), **extra)
        with StalledWorker(stacks.redis_url, idle.env["SAMPLING_QUEUE"]):
            one(idle.port, "/sample", b"warm-up", 60)
            for concurrency in (waits // 3, waits):
                late = _late_504s_ms(idle.port, concurrency)
                label = f"{worker_class}, {concurrency} simultaneous waits"
                rows.append((f"{label}: 504s / past deadline p50 / p99 / max (ms)",
                             f"{len(late)}/{concurrency} / {percentile(late, 50):.0f} / "
                             f"{percentile(late, 99):.0f} / {late[-1]:.0f}"))  # fmt: skip
                gevent.sleep(1)
        idle.stop()
    return rows


def _late_504s_ms(port: int, concurrency: int) -> list[float]:
    """`concurrency` requests sent evenly over 1.5 s: how late past the deadline each 504 came."""
    spacing = 1.5 / concurrency
    greenlets = []
    started = time.perf_counter()
    for i in range(concurrency):
        gevent.sleep(max(0.0, started + i * spacing - time.perf_counter()))
        greenlets.append(gevent.spawn(one, port, "/sample", f"wait {i}".encode(), 60))
    gevent.joinall(greenlets)
    results: list[tuple[int, str, float]] = [g.value for g in greenlets]
    return sorted(
        (seconds - HOLD_DEADLINE_MS / 1000) * 1000
        for status, _, seconds in results
        if status == 504
    )
