"""Offline jobs beside requests: what a job costs them, and how much of the empty places it fills.

    .venv/bin/python -m bench backfill [--rounds 5] [--seconds 10] [--max-batch 100]
        [--workers 1]

`--workers` simulated GPUs (100 ms calls of up to `--max-batch`: a limit of workers x
max-batch x 10 requests a second) behind two gevent web processes and the feeder, on an
embedded Redis, with a database of its own. With several GPUs and no load
(`--workers 4 --loads 0`), the job's rate is what one feeder writes, not what the GPUs run.
At each load (0, 10, 50, 90 and 100% of the limit), `--seconds` of open-loop Poisson
requests to /sample, once without a job and once while a job of `--job-lines` chat lines
(50,000) runs, in alternating order round after round; the job is created (and validated,
and its lanes fed) before the window opens, and cancelled after it (the next window opens
once it is). Per load, medians over the rounds:

- interactive goodput (200s a second) and latency p50/p99, without and with the job;
- the job's lines answered a second during the window: the slope of its `request_counts`,
  read every PROGRESS_EVERY_S;
- the places of the calls run (max batch size each) filled by requests, by the job, and
  empty (the workers' `sampling_call_places_total`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from batching.outcomes import RequestOutcome
from bench.harness import loadgen
from bench.harness.machine import describe_machine
from bench.harness.report import markdown_table
from bench.harness.stack import make_api_keys, new_queue, simulated_env, simulated_stack
from bench.harness.stats import median, slope
from bench.harness.trees import in_turn
from inference_site.lib.embedded_redis import EmbeddedRedis
from inference_site.lib.stack import Stack
from workers.lifecycle import HEARTBEAT_INTERVAL_S
from workers.samplers.simulated import expected_completion

CALL_MS = 100
# Workers publish their metrics with each heartbeat: a call's places are on /metrics this
# long after it at most (and a little more).
METRICS_EVERY_S = HEARTBEAT_INTERVAL_S + 0.5
FILLED = ("interactive", "backfill", "empty")
# A window reads its job's answered lines this often: the rate is their slope over time. Two
# reads' difference is off by up to a feeder's write of lines at each end (2 to 3% in 10 s).
PROGRESS_EVERY_S = 0.25


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=10.0, help="per window, default 10")
    parser.add_argument("--max-batch", type=int, default=100, help="default 100")
    parser.add_argument("--job-lines", type=int, default=50_000, help="default 50,000")
    parser.add_argument("--workers", type=int, default=1, help="simulated GPUs, default 1")
    parser.add_argument(
        "--loads", default="0,10,50,90,100", help="percents of the limit, default 0,10,50,90,100"
    )


def _places(stack: Stack) -> dict[str, float]:
    """The workers' places so far, by what filled them."""
    body = loadgen_get(stack, "/metrics")
    found = dict.fromkeys(FILLED, 0.0)
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == "sampling_call_places_total":
                found[sample.labels["filled"]] += sample.value
    return found


def loadgen_get(stack: Stack, path: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{stack.base_url}{path}", timeout=10) as answer:  # noqa: S310
        return str(answer.read().decode())


def _job(client: OpenAI, model: str, lines: int, tag: str) -> str:
    """A job created and under way (validated, its first items taken); its id."""
    content = b"".join(
        json.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": model, "max_tokens": 16, "seed": i,
                             "messages": [{"role": "user", "content": f"{tag} {i}"}]}}).encode()
        + b"\n"
        for i in range(lines)
    )  # fmt: skip
    uploaded = client.files.create(file=("job.jsonl", io.BytesIO(content)), purpose="batch")
    job = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                completion_window="24h")  # fmt: skip
    deadline = time.monotonic() + 120
    while _answered(client, job.id) == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    return job.id


def _cancelled(client: OpenAI, job_id: str) -> None:
    deadline = time.monotonic() + 60
    while client.batches.retrieve(job_id).status != "cancelled":
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job_id} was not cancelled within 60 s")
        time.sleep(0.1)


def _answered(client: OpenAI, job_id: str) -> int:
    counts = client.batches.retrieve(job_id).request_counts
    return counts.completed + counts.failed if counts else 0


class _Progress:
    """A job's answered lines over a window, read in a thread of its own."""

    def __init__(self, client: OpenAI, job_id: str) -> None:
        self.client, self.job_id = client, job_id
        self.points: list[tuple[float, float]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._read, name="progress", daemon=True)

    def __enter__(self) -> _Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _read(self) -> None:
        while True:
            self.points.append((time.monotonic(), _answered(self.client, self.job_id)))
            if self._done.wait(PROGRESS_EVERY_S):
                self.points.append((time.monotonic(), _answered(self.client, self.job_id)))
                return

    def rate(self) -> float:
        return slope(self.points)


def _window(
    stack: Stack, client: OpenAI, args: argparse.Namespace, load: float, job: bool, tag: str
) -> dict[str, float]:
    limit = _limit(args)
    job_id = _job(client, stack.env["SAMPLING_QUEUE"], args.job_lines, tag) if job else ""
    places = _places(stack)
    with contextlib.ExitStack() as running:
        progress = running.enter_context(_Progress(client, job_id)) if job else None
        if load:
            results = loadgen.run(
                "127.0.0.1", stack.port or 0, "/sample", limit * load, args.seconds,
                lambda i: f"{tag} {i}", expected_completion, client_timeout_s=3.0,
            )  # fmt: skip
        else:
            time.sleep(args.seconds)  # duration: the window with no requests
    after = _places(stack)
    figures = {name: after[name] - places[name] for name in FILLED}
    if progress is not None:
        figures["job_rps"] = progress.rate()
        client.batches.cancel(job_id)
        _cancelled(client, job_id)  # none of its items left to run in the next window
        time.sleep(METRICS_EVERY_S)  # duration: its last calls' places reach /metrics
    if load:
        wrong = results.count(loadgen.WRONG)
        if wrong:
            raise RuntimeError(f"{wrong} requests got someone else's completion")
        figures["goodput"] = results.goodput_rps
        figures["p50"] = results.percentile_ms(50, RequestOutcome.OK)
        figures["p99"] = results.percentile_ms(99, RequestOutcome.OK)
    return figures


def _limit(args: argparse.Namespace) -> float:
    return args.workers * args.max_batch * 1000 / CALL_MS


def main(args: argparse.Namespace) -> None:
    print(describe_machine(), flush=True)
    server = EmbeddedRedis().start()
    files = Path(tempfile.mkdtemp(prefix="bench-backfill-"))
    env = simulated_env(server.url, new_queue("backfill"), call_ms=CALL_MS,
                        max_batch=args.max_batch, SAMPLING_FILES_DIR=str(files))  # fmt: skip
    stack = simulated_stack(env, [None] * args.workers)
    runs: dict[tuple[float, bool], list[dict[str, float]]] = {}
    loads = [int(percent) / 100 for percent in args.loads.split(",")]
    try:
        stack.start(timeout_s=120)
        key = make_api_keys(stack, {"bench-backfill": []})["bench-backfill"]
        client = OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0,
                        timeout=120)  # fmt: skip
        for round_index in range(args.rounds):
            for load in loads:
                for job in in_turn((False, True), round_index + int(load * 10)):
                    tag = f"r{round_index}-{load}-{int(job)}"
                    figures = _window(stack, client, args, load, job, tag)
                    runs.setdefault((load, job), []).append(figures)
                    shown = "  ".join(f"{k} {v:.1f}" for k, v in figures.items())
                    print(f"  round {round_index + 1} load {load:.0%} job {job}: {shown}",
                          flush=True)  # fmt: skip
    finally:
        stack.stop()
        server.stop()
    print(f"\n{_table(runs, loads, args)}")


def _table(
    runs: dict[tuple[float, bool], list[dict[str, float]]],
    loads: list[float],
    args: argparse.Namespace,
) -> str:
    def of(load: float, job: bool, name: str) -> float:
        values = [run[name] for run in runs.get((load, job), []) if name in run]
        return median(values) if values else float("nan")

    def share(load: float, name: str) -> str:
        total = sum(of(load, True, filled) for filled in FILLED)
        return f"{100 * of(load, True, name) / total:.0f}%" if total else "-"

    rows: list[list[Any]] = []
    number: Callable[[float], str] = lambda value: "-" if value != value else f"{value:,.1f}"  # noqa: E731
    for load in loads:
        rows.append([
            f"{load:.0%}", number(of(load, False, "goodput")), number(of(load, True, "goodput")),
            number(of(load, False, "p50")), number(of(load, True, "p50")),
            number(of(load, False, "p99")), number(of(load, True, "p99")),
            number(of(load, True, "job_rps")), *(share(load, name) for name in FILLED),
        ])  # fmt: skip
    limit = _limit(args)
    title = (
        f"{args.workers} simulated GPU(s), {CALL_MS} ms calls of up to {args.max_batch} "
        f"(limit {limit:g}/s); "
        f"medians of {args.rounds} rounds of {args.seconds:g} s windows"
    )
    header = ["load", "goodput/s", "with job", "p50 ms", "with job", "p99 ms", "with job",
              "job lines/s", "places: requests", "job", "empty"]  # fmt: skip
    return f"{title}\n\n{markdown_table(header, rows)}\n"
