"""Offline jobs beside requests: what a job costs them, and how much of the empty places it fills.

    .venv/bin/python -m bench backfill [--rounds 5] [--seconds 10] [--max-batch 100]
        [--workers 1] [--cost contract|h100-graphs-135m|FILE] [--sampler simulated|hf] [--aa]

`--workers` simulated GPUs (100 ms calls of up to `--max-batch`) behind two gevent web
processes and the feeder, on an embedded Redis, with a database of its own. At each load
(0, 10, 50, 90 and 100% of the limit), `--seconds` of open-loop Poisson requests to /sample,
once without a job and once while a job of `--job-lines` chat lines runs, in alternating
order round after round; the job is created and fed before the window opens, and cancelled
after it. `--cost` prices the calls on a cost profile (batching.call_cost): on a curve, every
row runs to 16 new tokens, as the job's lines ask (74.9 ms for 1 row on the H100's, 209.4 ms
for 100). `--sampler hf` runs the packaged SmolLM2 (on a GPU if any), 16 new tokens a row,
its loads in `--cost`'s full calls (h100-graphs-135m unless named), its texts unchecked.
`--aa` adds a third window a round without the job: how far two windows alike read apart.
Per load, medians over the rounds:

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
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from batching.call_cost import CONTRACT
from batching.outcomes import RequestOutcome
from bench.backfill import report
from bench.harness import jobs, loadgen
from bench.harness.costs import Calls
from bench.harness.machine import describe_machine
from bench.harness.stack import make_api_keys, new_queue, simulated_env, simulated_stack
from bench.harness.trees import in_turn
from devstack.embedded_redis import EmbeddedRedis
from devstack.stack import Stack
from telemetry.batch_log import BatchLog
from workers.heartbeat import HEARTBEAT_INTERVAL_S
from workers.launch import local_gpu_count

CALL_MS = 100
# Workers publish their metrics with each heartbeat: a call's places are on /metrics this
# long after it at most (and a little more).
METRICS_EVERY_S = HEARTBEAT_INTERVAL_S + 0.5
HF_LIMIT_COST = "h100-graphs-135m"  # the packaged model's loads, in this profile's full calls


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=10.0, help="per window, default 10")
    parser.add_argument("--max-batch", type=int, default=100, help="default 100")
    parser.add_argument("--job-lines", type=int, default=50_000, help="default 50,000")
    parser.add_argument("--workers", type=int, default=1, help="simulated GPUs, default 1")
    parser.add_argument(
        "--loads", default="0,10,50,90,100", help="percents of the limit, default 0,10,50,90,100"
    )
    parser.add_argument("--cost", default=CONTRACT, help="a cost profile, default contract")
    parser.add_argument("--sampler", choices=("simulated", "hf"), default="simulated")
    parser.add_argument("--aa", action="store_true", help="a second window without the job")


def _places(stack: Stack) -> dict[str, float]:
    """The workers' places so far, by what filled them."""
    body = loadgen_get(stack, "/metrics")
    found = dict.fromkeys(report.FILLED, 0.0)
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
    limit, timeout_s = _limit(args), int(stack.env.get("SAMPLING_DEADLINE_MS", 500)) / 1000 + 3
    job_id = jobs.start(client, stack.env["SAMPLING_QUEUE"], args.job_lines, tag) if job else ""
    places, since_ms = _places(stack), _now_ms()
    with contextlib.ExitStack() as running:
        progress = running.enter_context(jobs.Progress(client, job_id)) if job else None
        if load:
            results = loadgen.run(
                "127.0.0.1", stack.port or 0, "/sample", limit * load, args.seconds,
                lambda i: f"{tag} {i}", _expected(args), client_timeout_s=timeout_s,
            )  # fmt: skip
        else:
            time.sleep(args.seconds)  # duration: the window with no requests
    after, until_ms = _places(stack), _now_ms()
    figures = {name: after[name] - places[name] for name in report.FILLED}
    figures["between_calls_ms"] = report.between_calls_ms(records, since_ms, until_ms)
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


def _calls(args: argparse.Namespace) -> Calls:
    cost = HF_LIMIT_COST if args.sampler == "hf" and args.cost == CONTRACT else args.cost
    return Calls(cost, CALL_MS, args.max_batch)


def _expected(args: argparse.Namespace) -> Callable[[str], str] | None:  # None: a model's text
    return _calls(args).expected() if args.sampler == "simulated" else None


def _sampler_env(args: argparse.Namespace) -> tuple[dict[str, str], list[int | None]]:
    """The workers' settings and GPUs: the simulated sampler's curve, or the packaged model."""
    if args.sampler == "simulated":
        return _calls(args).env(), [None] * args.workers
    env = {"SAMPLER": "hf", "SAMPLING_MODEL": "", "SAMPLING_MAX_NEW_TOKENS": "16"}
    if local_gpu_count():
        return env, list(range(args.workers))
    cpu = {"SAMPLING_DEADLINE_MS": "60000", "SAMPLING_CALL_TIMEOUT_MS": "60000"}  # calls of s
    return {**env, **cpu}, [None] * args.workers


def _limit(args: argparse.Namespace) -> float:  # requests a second in full calls
    return _calls(args).limit_rps(args.workers)


def main(args: argparse.Namespace) -> None:
    print(describe_machine(), flush=True)
    server = EmbeddedRedis().start()
    files = Path(tempfile.mkdtemp(prefix="bench-backfill-"))
    env = simulated_env(server.url, new_queue("backfill"), call_ms=CALL_MS,
                        max_batch=args.max_batch, SAMPLING_FILES_DIR=str(files))  # fmt: skip
    sampler_env, gpus = _sampler_env(args)
    stack = simulated_stack({**env, **sampler_env}, gpus)
    runs: report.Runs = {}
    kinds = (report.ALONE, report.JOB, report.AGAIN) if args.aa else (report.ALONE, report.JOB)
    loads = [int(percent) / 100 for percent in args.loads.split(",")]
    try:
        stack.start(timeout_s=300)
        key = make_api_keys(stack, {"bench-backfill": []})["bench-backfill"]
        records = BatchLog(redis.Redis.from_url(server.url), env["SAMPLING_QUEUE"])
        client = OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0,
                        timeout=120)  # fmt: skip
        for round_index in range(args.rounds):
            for load in loads:
                for kind in in_turn(kinds, round_index + int(load * 10)):
                    tag = f"r{round_index}-{load}-{kind}"
                    figures = _window(stack, client, records, args, load, kind == report.JOB, tag)
                    runs.setdefault((load, kind), []).append(figures)
                    shown = "  ".join(f"{k} {v:.1f}" for k, v in figures.items())
                    print(f"  round {round_index + 1} load {load:.0%} {kind}: {shown}",
                          flush=True)  # fmt: skip
    finally:
        stack.stop()
        server.stop()
    limit, calls = _limit(args), _calls(args).describe()
    runs_on = f"{args.workers} simulated GPU(s), {calls}" if args.sampler == "simulated" else (
        f"{args.workers} worker(s) of the packaged SmolLM2 (loads in {calls})")  # fmt: skip
    title = (
        f"{runs_on} of up to {args.max_batch} (limit {limit:,.0f}/s); "
        f"medians of {args.rounds} rounds of {args.seconds:g} s windows"
    )
    print(f"\n{title}\n\n{report.table(runs, loads, aa=args.aa)}")
