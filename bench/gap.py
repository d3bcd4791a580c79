"""How long a GPU waits for its worker between two calls, and the latencies around a call.

    .venv/bin/python -m bench.gap                        # this tree, 3 rounds (~6 minutes)
    .venv/bin/python -m bench.gap --against 95c8405      # and an older commit, alternating
    .venv/bin/python -m bench.gap --write-costs          # also write planning/costs.json

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
import http.client
import itertools
import json
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import redis
from celery import Celery

from batching.aggregator import BatchAggregator
from batching.outcomes import ItemOutcome, RequestOutcome
from batching.protocol import RUN_BATCH_TASK
from bench import loadgen
from bench.compare import describe_machine
from inference_site.lib.embedded_redis import redis_url_or_embedded
from inference_site.lib.stack import ROOT, Stack
from workers.samplers.simulated import expected_completion

SHIMS = Path(__file__).resolve().parent / "shims"
COSTS = ROOT / "planning" / "costs.json"
CALL_MS = 100
MAX_BATCH = 100
DRAIN_BATCHES = 40
SATURATED_LOAD = 1.2  # of the limit, 1,000 req/s for one worker
LONE_LOAD = 0.1  # of the calls two workers can run per second


@dataclass(frozen=True)
class Call:
    start: float  # epoch seconds, as the worker's clock reads them
    end: float
    size: int
    first_prompt: str

    @property
    def ms(self) -> float:
        return (self.end - self.start) * 1000


def read_calls(path: Path, prefix: str) -> list[Call]:
    calls = []
    for line in path.read_text().splitlines():
        start, end, size, prompt = line.split(" ", 3)
        if prompt.startswith(prefix):
            calls.append(Call(float(start), float(end), int(size), prompt))
    return sorted(calls, key=lambda call: call.start)


def gaps_ms(calls: list[Call]) -> list[float]:
    return [(after.start - before.end) * 1000 for before, after in itertools.pairwise(calls)]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def pct(values: list[float], q: float) -> float:
    return loadgen.percentile(values, q)


@dataclass
class Tree:
    """A version of the code: this checkout, or an older commit's worktree."""

    name: str
    root: Path


@dataclass
class Bench:
    redis_url: str
    rounds: int
    saturated_s: float
    lone_s: float
    single_requests: int
    work: Path
    figures: dict[tuple[str, str], list[dict[str, float]]] = field(default_factory=dict)

    def env(self, queue: str, log: Path, **extra: str) -> dict[str, str]:
        return {
            "REDIS_URL": self.redis_url,
            "SAMPLER": "gap_sampler:TimedSampler",
            "SIMULATED_BATCH_MS": str(CALL_MS),
            "SAMPLING_MAX_BATCH_SIZE": str(MAX_BATCH),
            "SAMPLING_QUEUE": queue,
            "BENCH_CALL_LOG": str(log),
            "PYTHONPATH": str(SHIMS),
            "DJANGO_SECRET_KEY": "bench-only-" + uuid.uuid4().hex,
            "LOG_LEVEL": "warning",
            **extra,
        }

    def record(self, tree: Tree, scenario: str, figures: dict[str, float]) -> None:
        self.figures.setdefault((tree.name, scenario), []).append(figures)
        shown = "  ".join(f"{name} {value:.2f}" for name, value in figures.items())
        print(f"  {tree.name:<8} {scenario:<10} {shown}", flush=True)

    @contextmanager
    def stack(
        self, tree: Tree, scenario: str, gpus: list[int | None], env: dict[str, str] | None = None
    ) -> Iterator[tuple[Stack, Path]]:
        """A stack of `tree`'s code, not started, with the timing sampler logging to the
        returned file."""
        queue = f"gap-{scenario}-{uuid.uuid4().hex[:8]}"
        log = self.work / f"{queue}.calls"
        log.touch()
        stack = Stack(
            env=self.env(queue, log, **(env or {})),
            gpus=gpus,
            root=tree.root,
            log_dir=self.work / queue,
            own_database=True,
        )
        try:
            yield stack, log
        finally:
            stack.stop()

    # --- the scenarios ---------------------------------------------------------------------
    def drain(self, tree: Tree) -> None:
        deadline_ms = 120_000  # nothing expires while the batches wait for the worker
        env = {"SAMPLING_DEADLINE_MS": str(deadline_ms)}
        with self.stack(tree, "drain", gpus=[], env=env) as (stack, log):
            client = redis.Redis.from_url(self.redis_url)
            queue = stack.env["SAMPLING_QUEUE"]
            app = Celery("gap-bench", set_as_current=False)
            app.conf.update(broker_url=self.redis_url, result_backend=self.redis_url)
            aggregator = BatchAggregator(
                client, queue, max_batch_size=MAX_BATCH, deadline_ms=deadline_ms
            )
            batch_ids: list[str] = []
            for k in range(DRAIN_BATCHES):
                for i in range(MAX_BATCH):
                    ticket = aggregator.append(f"drain {k} {i}", deadline_ms)
                    if ticket.opened:
                        app.send_task(
                            RUN_BATCH_TASK,
                            args=(ticket.batch_id, queue),
                            task_id=ticket.batch_id,
                            queue=queue,
                        )
                        aggregator.dispatched(ticket.batch_id)
                        batch_ids.append(ticket.batch_id)
            published = _ResultTimes(self.redis_url, batch_ids)
            stack.start_worker(None)
            give_up = time.monotonic() + 90
            while len(read_calls(log, "drain ")) < DRAIN_BATCHES and time.monotonic() < give_up:
                time.sleep(0.2)
            time.sleep(0.5)
            published.stop()
            calls = read_calls(log, "drain ")
            wrong = 0
            for k, batch_id in enumerate(batch_ids):
                meta = app.backend.get_task_meta(batch_id)
                answers = meta.get("result") or []
                expected = [
                    [ItemOutcome.OK, expected_completion(f"drain {k} {i}")]
                    for i in range(MAX_BATCH)
                ]
                if len(answers) != MAX_BATCH:
                    wrong += MAX_BATCH
                    continue
                pairs = zip(answers, expected, strict=True)
                wrong += sum(1 for got, want in pairs if list(got) != want)
            ends = {int(call.first_prompt.split()[1]): call.end for call in calls}
            delivery = [
                (published.times[batch_id] - ends[k]) * 1000
                for k, batch_id in enumerate(batch_ids)
                if batch_id in published.times and k in ends
            ]
            gaps = gaps_ms(calls)
            self.record(
                tree,
                "drain",
                {
                    "calls": len(calls),
                    "gap_p50": median(gaps),
                    "gap_p90": pct(gaps, 90),
                    "gap_min": min(gaps, default=float("nan")),
                    "result_p50": median(delivery),
                    "result_p90": pct(delivery, 90),
                    "wrong": wrong,
                },
            )

    def saturated(self, tree: Tree) -> None:
        with self.stack(tree, "saturated", gpus=[None]) as (stack, log):
            stack.start(timeout_s=60)
            tag = uuid.uuid4().hex[:6]
            results = loadgen.run(
                "127.0.0.1",
                stack.port,
                "/sample",
                SATURATED_LOAD * MAX_BATCH * 1000 / CALL_MS,
                self.saturated_s,
                lambda i: f"sat {tag} {i}",
                expected_completion,
                client_timeout_s=3.0,
            )
            calls = read_calls(log, f"sat {tag} ")
            # The backlog's span: from one second in (the queue has formed) to the last call
            # that started while requests were still arriving.
            first = calls[0].start + 1.0 if calls else 0.0
            last = first - 1.0 + self.saturated_s
            steady = [call for call in calls if first <= call.start <= last]
            gaps = gaps_ms(steady)
            span = (steady[-1].end - steady[0].start) if steady else float("nan")
            self.record(
                tree,
                "saturated",
                {
                    "calls": len(steady),
                    "gap_p50": median(gaps),
                    "gap_p90": pct(gaps, 90),
                    "gap_max": max(gaps, default=float("nan")),
                    "busy_%": 100 * sum(c.end - c.start for c in steady) / span,
                    "batch": statistics.mean(c.size for c in steady) if steady else 0.0,
                    "ok_%": 100 * results.share(RequestOutcome.OK),
                    "503_%": 100 * results.share(RequestOutcome.REJECTED),
                    "504_%": 100 * results.share(RequestOutcome.TIMEOUT),
                    "wrong": results.count(loadgen.WRONG) + results.count(loadgen.OTHER),
                },
            )

    def lone(self, tree: Tree) -> None:
        workers = 2
        with self.stack(tree, "lone", gpus=[0, 1]) as (stack, log):
            stack.start(timeout_s=60)
            tag = uuid.uuid4().hex[:6]
            rate = LONE_LOAD * workers * 1000 / CALL_MS
            results = loadgen.run(
                "127.0.0.1",
                stack.port,
                "/sample",
                rate,
                self.lone_s,
                lambda i: f"lone {tag} {i}",
                expected_completion,
                client_timeout_s=3.0,
                seed=int(time.time()),
            )
            call_ms = median([c.ms for c in read_calls(log, f"lone {tag} ")])
            intended = results.intended_s
            sent = [i + lag / 1000 for i, lag in zip(intended, results.send_lag_ms, strict=True)]
            answered = [i + ms / 1000 for i, ms in zip(intended, results.latencies_ms, strict=True)]
            lone = [
                results.latencies_ms[i] - call_ms
                for i, at in enumerate(sent)
                if results.outcomes[i] == RequestOutcome.OK
                and sum(1 for j in range(len(sent)) if j != i and sent[j] <= at < answered[j])
                < workers
            ]
            for outcome, example in results.examples.items():
                if outcome != RequestOutcome.OK:
                    print(f"  {tree.name:<8} lone: {outcome}: {example}", flush=True)
            self.record(
                tree,
                "lone",
                {
                    "requests": results.sent,
                    "lone": len(lone),
                    "p50_over_call": median(lone),
                    "p99_over_call": pct(lone, 99),
                    "max_over_call": max(lone, default=float("nan")),
                    "not_ok": results.sent - results.count(RequestOutcome.OK),
                },
            )

    def single(self, tree: Tree) -> None:
        with self.stack(tree, "single", gpus=[None]) as (stack, log):
            stack.start(timeout_s=60)
            tag = uuid.uuid4().hex[:6]
            for i in range(5):  # connections, caches, the worker's first tasks
                _post(stack.port, f"warm {tag} {i}")
            timings = []
            for i in range(self.single_requests):
                prompt = f"single {tag} {i}"
                sent = time.time()
                status, body = _post(stack.port, prompt)
                answered = time.time()
                if status != 200 or body != expected_completion(prompt):
                    raise SystemExit(f"single: {status} {body!r} for {prompt!r}")
                timings.append((prompt, sent, answered))
                time.sleep(0.05)  # the worker back at rest
            calls = {c.first_prompt: c for c in read_calls(log, f"single {tag} ")}
            call_ms = median([c.ms for c in calls.values()])
            latency = [(answered - sent) * 1000 - call_ms for _, sent, answered in timings]
            dispatch = [(calls[p].start - sent) * 1000 for p, sent, _ in timings if p in calls]
            back = [(answered - calls[p].end) * 1000 for p, _, answered in timings if p in calls]
            self.record(
                tree,
                "single",
                {
                    "p50_over_call": median(latency),
                    "p90_over_call": pct(latency, 90),
                    "dispatch_p50": median(dispatch),
                    "return_p50": median(back),
                    "call_ms": call_ms,
                },
            )


class _ResultTimes:
    """When each awaited result is published, as a subscriber of its channel sees it."""

    def __init__(self, redis_url: str, task_ids: list[str]) -> None:
        self.times: dict[str, float] = {}
        self._pubsub = redis.Redis.from_url(redis_url).pubsub(ignore_subscribe_messages=True)
        self._pubsub.subscribe(*(f"celery-task-meta-{task_id}" for task_id in task_ids))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while not self._stop.is_set():
            message = self._pubsub.get_message(timeout=0.1)
            if message is not None:
                at = time.time()
                channel = message["channel"].decode()
                self.times.setdefault(channel.removeprefix("celery-task-meta-"), at)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._pubsub.close()


def _post(port: int, prompt: str) -> tuple[int, str]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("POST", "/sample", body=prompt.encode())
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


@contextmanager
def worktree(ref: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gap-against-"))
    subprocess.run(
        ["git", "worktree", "add", "--detach", "--quiet", str(path), ref], cwd=ROOT, check=True
    )
    try:
        yield path
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, check=False)
        shutil.rmtree(path, ignore_errors=True)


def table(bench: Bench, trees: list[Tree], scenario: str) -> str:
    rows = [(tree, bench.figures.get((tree.name, scenario), [])) for tree in trees]
    names = next((list(runs[0]) for _, runs in rows if runs), [])
    if not names:
        return ""
    lines = [
        f"### {scenario} (median of {max(len(runs) for _, runs in rows)} rounds)",
        "",
        "| code | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for tree, runs in rows:
        if runs:
            cells = [f"{statistics.median(run[name] for run in runs):.2f}" for name in names]
            lines.append(f"| {tree.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_costs(bench: Bench, tree: Tree) -> None:
    def figure(scenario: str, name: str) -> float:
        return round(statistics.median(r[name] for r in bench.figures[(tree.name, scenario)]), 2)

    costs = {
        "gap_ms": figure("saturated", "gap_p50"),
        "dispatch_ms": figure("single", "dispatch_p50"),
        "path_ms": figure("single", "return_p50"),
        "measured": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": describe_machine(),
        "command": "python -m bench.gap --write-costs",
        "rounds": bench.rounds,
    }
    COSTS.write_text(json.dumps(costs, indent=2) + "\n")
    print(f"wrote {COSTS.relative_to(ROOT)}: {costs}")


SCENARIOS = ["drain", "saturated", "lone", "single"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", help="a git ref to measure in the same run, alternating")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=SCENARIOS)
    parser.add_argument("--saturated-seconds", type=float, default=5.0)
    parser.add_argument("--lone-seconds", type=float, default=60.0)
    parser.add_argument("--single-requests", type=int, default=60)
    parser.add_argument("--write-costs", action="store_true", help="write planning/costs.json")
    args = parser.parse_args()

    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="bench-gap-"))
    trees = [Tree("this", ROOT)]
    with contextlib.ExitStack() as resources:
        redis_url = resources.enter_context(redis_url_or_embedded())
        if args.against:
            trees.insert(0, Tree(args.against[:8], resources.enter_context(worktree(args.against))))
        bench = Bench(
            redis_url, args.rounds, args.saturated_seconds, args.lone_seconds,
            args.single_requests, work,
        )  # fmt: skip
        for round_number in range(1, args.rounds + 1):
            print(f"round {round_number}/{args.rounds}", flush=True)
            for scenario in args.scenarios:
                # Alternate which version goes first, so neither always runs on a machine
                # the other just warmed up (or disturbed).
                for tree in trees if round_number % 2 else trees[::-1]:
                    getattr(bench, scenario)(tree)
    print(f"\n{describe_machine()}; call {CALL_MS} ms; {time.monotonic() - started:.0f} s\n")
    for scenario in args.scenarios:
        print(table(bench, trees, scenario))
    if args.write_costs:
        write_costs(bench, trees[-1])
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
