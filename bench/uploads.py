"""A big upload beside requests: what a 150 MB file sent to /v1/files costs the requests that
the same web processes serve.

    .venv/bin/python -m bench uploads [--rounds 5] [--seconds 8] [--megabytes 150]
        [--load 50]

One simulated GPU (100 ms calls of up to 100) behind two gevent web processes, on an embedded
Redis, with a database of its own. Each round has two windows of `--seconds` of open-loop
Poisson requests to /sample at `--load` percent of the GPU's limit: one without an upload and
one during which a file of `--megabytes` of JSONL lines is uploaded (its POST starts one
second into the window, and every upload of a round ends before its window does), in
alternating order round after round. Per round, the p99 of the 200s' latency without and
with the upload, and their difference; the table gives each round and the medians.
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import threading
import time
from pathlib import Path

from openai import OpenAI

from batching.outcomes import RequestOutcome
from bench.harness import loadgen
from bench.harness.machine import describe_machine
from bench.harness.report import markdown_table
from bench.harness.stack import make_api_keys, new_queue, simulated_env, simulated_stack
from bench.harness.stats import median
from bench.harness.trees import in_turn
from inference_site.lib.embedded_redis import EmbeddedRedis
from inference_site.lib.stack import Stack
from workers.samplers.simulated import expected_completion

CALL_MS = 100
MAX_BATCH = 100
UPLOAD_AFTER_S = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=8.0, help="per window, default 8")
    parser.add_argument("--megabytes", type=int, default=150, help="the upload, default 150")
    parser.add_argument("--load", type=int, default=50, help="percent of the limit, default 50")


def jsonl(megabytes: int, model: str) -> bytes:
    """About `megabytes` MB of chat lines, each its own custom_id."""
    lines, size, index = [], 0, 0
    while size < megabytes * 10**6:
        line = json.dumps(
            {
                "custom_id": f"u-{index}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "messages": [{"role": "user", "content": f"question {index} " + "x" * 900}],
                },
            }
        )
        lines.append(line.encode() + b"\n")  # fmt: skip
        size += len(lines[-1])
        index += 1
    return b"".join(lines)


def _window(stack: Stack, rate: float, seconds: float, upload: bytes | None, tag: str) -> float:
    """The p99 (ms) of the 200s of one window, with `upload` sent during it (or none)."""
    uploaded: list[float] = []

    def send() -> None:
        time.sleep(UPLOAD_AFTER_S)  # duration: the window's requests under way first
        client = OpenAI(base_url=f"{stack.base_url}/v1", api_key=stack.env["BENCH_KEY"],
                        max_retries=0, timeout=600)  # fmt: skip
        began = time.monotonic()
        client.files.create(file=("big.jsonl", io.BytesIO(upload or b"")), purpose="batch")
        uploaded.append(time.monotonic() - began)

    sender = threading.Thread(target=send) if upload else None
    if sender is not None:
        sender.start()
    results = loadgen.run(
        "127.0.0.1", stack.port or 0, "/sample", rate, seconds, lambda i: f"{tag} {i}",
        expected_completion, client_timeout_s=3.0,
    )  # fmt: skip
    if sender is not None:
        sender.join()
        if uploaded[0] > seconds - UPLOAD_AFTER_S:
            print(f"    (the upload took {uploaded[0]:.1f} s: past its window)", flush=True)
    if results.count(loadgen.WRONG):
        raise RuntimeError("a request got someone else's completion")
    return results.percentile_ms(99, RequestOutcome.OK)


def main(args: argparse.Namespace) -> None:
    print(describe_machine(), flush=True)
    server = EmbeddedRedis().start()
    files = Path(tempfile.mkdtemp(prefix="bench-uploads-"))
    env = simulated_env(server.url, new_queue("uploads"), call_ms=CALL_MS, max_batch=MAX_BATCH,
                        SAMPLING_FILES_DIR=str(files))  # fmt: skip
    stack = simulated_stack(env, [None])
    rate = MAX_BATCH * 1000 / CALL_MS * args.load / 100
    upload = jsonl(args.megabytes, env["SAMPLING_QUEUE"])
    rows = []
    try:
        stack.start(timeout_s=120)
        stack.env["BENCH_KEY"] = make_api_keys(stack, {"bench-uploads": []})["bench-uploads"]
        for round_index in range(args.rounds):
            p99 = {}
            for with_upload in in_turn((False, True), round_index):
                tag = f"r{round_index}-{int(with_upload)}"
                p99[with_upload] = _window(stack, rate, args.seconds,
                                           upload if with_upload else None, tag)  # fmt: skip
            rows.append((p99[False], p99[True], p99[True] - p99[False]))
            print(f"  round {round_index + 1}: p99 {p99[False]:.1f} ms without, "
                  f"{p99[True]:.1f} ms with the upload", flush=True)  # fmt: skip
    finally:
        stack.stop()
        server.stop()
    table = [[f"{i + 1}", f"{a:.1f}", f"{b:.1f}", f"{d:+.1f}"] for i, (a, b, d) in enumerate(rows)]
    table.append(["median", *(f"{median([row[k] for row in rows]):.1f}" for k in range(2)),
                  f"{median([row[2] for row in rows]):+.1f}"])  # fmt: skip
    print(f"\n{args.megabytes} MB upload; /sample at {args.load}% of one simulated GPU's limit "
          f"({rate:g}/s), {args.seconds:g} s windows\n")  # fmt: skip
    print(markdown_table(["round", "p99 ms without", "p99 ms with upload", "difference"], table))
