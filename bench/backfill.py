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
  empty (the workers' `sampling_call_places_total`);
- how long the GPU waited between two calls, on average, without and with the job (the
  workers' batch records: an idle GPU's wait, or the seal and rows of the next call).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from batching.aggregator import BatchAggregator
from batching.batch_log import BatchLog
from batching.outcomes import RequestOutcome
from bench.harness import jobs, loadgen
from bench.harness.machine import describe_machine
from bench.harness.report import markdown_table
from bench.harness.stack import make_api_keys, new_queue, simulated_env, simulated_stack
from bench.harness.stats import median
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


def _window(
    stack: Stack,
    client: OpenAI,
    records: BatchLog,
    args: argparse.Namespace,
    load: float,
    job: bool,
    tag: str,
) -> dict[str, float]:
    limit = _limit(args)
    job_id = jobs.start(client, stack.env["SAMPLING_QUEUE"], args.job_lines, tag) if job else ""
    places, since_ms = _places(stack), _now_ms()
    with contextlib.ExitStack() as running:
        progress = running.enter_context(jobs.Progress(client, job_id)) if job else None
        if load:
            results = loadgen.run(
                "127.0.0.1", stack.port or 0, "/sample", limit * load, args.seconds,
                lambda i: f"{tag} {i}", expected_completion, client_timeout_s=3.0,
            )  # fmt: skip
        else:
            time.sleep(args.seconds)  # duration: the window with no requests
    after, until_ms = _places(stack), _now_ms()
    figures = {name: after[name] - places[name] for name in FILLED}
    figures["between_calls_ms"] = _between_calls_ms(records, since_ms, until_ms)
    if progress is not None:
        figures["job_rps"] = progress.rate()
        client.batches.cancel(job_id)
        jobs.wait_cancelled(client, job_id)  # none of its items left to run in the next window
        time.sleep(METRICS_EVERY_S)  # duration: its last calls' places reach /metrics
    if load:
        wrong = results.count(loadgen.WRONG)
        if wrong:
            raise RuntimeError(f"{wrong} requests got someone else's completion")
        figures["goodput"] = results.goodput_rps
        figures["p50"] = results.percentile_ms(50, RequestOutcome.OK)
        figures["p99"] = results.percentile_ms(99, RequestOutcome.OK)
    return figures


def _now_ms() -> int:
    """This machine's clock, which is the embedded Redis node's: the records' times."""
    return int(time.time() * 1000)


def _between_calls_ms(records: BatchLog, since_ms: int, until_ms: int) -> float:
    """How long a GPU waited between two of its calls started in the window, on average
    (from one call's end to the next one's start: the seal and the rows, or an idle GPU);
    from the workers' batch records. A mean: the records' times are whole milliseconds, and
    the mean of their differences is exact but for its two ends."""
    by_worker: dict[str, list[dict[str, Any]]] = {}
    for raw in records.recent():
        record = json.loads(raw)
        started = record.get("call_started_ms")
        if started is not None and since_ms <= started <= until_ms:
            by_worker.setdefault(record["worker"], []).append(record)
    gaps = []
    for calls in by_worker.values():
        calls.sort(key=lambda record: record["call_started_ms"])
        gaps += [after["call_started_ms"] - before["call_started_ms"] - before["sampler_ms"]
                 for before, after in itertools.pairwise(calls)]  # fmt: skip
    return sum(gaps) / len(gaps) if gaps else float("nan")


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
        records = BatchAggregator(redis.Redis.from_url(server.url), env["SAMPLING_QUEUE"]).batch_log
        client = OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0,
                        timeout=120)  # fmt: skip
        for round_index in range(args.rounds):
            for load in loads:
                for job in in_turn((False, True), round_index + int(load * 10)):
                    tag = f"r{round_index}-{load}-{int(job)}"
                    figures = _window(stack, client, records, args, load, job, tag)
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
            number(of(load, False, "between_calls_ms")), number(of(load, True, "between_calls_ms")),
        ])  # fmt: skip
    limit = _limit(args)
    title = (
        f"{args.workers} simulated GPU(s), {CALL_MS} ms calls of up to {args.max_batch} "
        f"(limit {limit:g}/s); "
        f"medians of {args.rounds} rounds of {args.seconds:g} s windows"
    )
    header = ["load", "goodput/s", "with job", "p50 ms", "with job", "p99 ms", "with job",
              "job lines/s", "places: requests", "job", "empty", "between calls ms",
              "with job"]  # fmt: skip
    return f"{title}\n\n{markdown_table(header, rows)}\n"
