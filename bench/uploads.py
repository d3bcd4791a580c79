"""A big upload beside requests: what a 150 MB file sent to /v1/files costs the requests that
the same web processes serve.

    .venv/bin/python -m bench uploads [--rounds 5] [--seconds 12] [--megabytes 150]
        [--load 50]

One simulated GPU (100 ms calls of up to 100) behind two gevent web processes, on an embedded
Redis, with a database of its own. Each round has two windows of `--seconds` of open-loop
Poisson requests to /sample at `--load` percent of the GPU's limit: one without an upload and
one during which a file of `--megabytes` of JSONL lines is uploaded with curl (its POST
starts one second into the window, and every upload of a round ends before its window does),
in alternating order round after round. curl runs as a process of its own: a client in the
load generator's process would slow the load generator itself. Per round, the p99 of the
200s' latency without and with the upload, and their difference; the table gives each round
and the medians.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from batching.outcomes import RequestOutcome
from bench.harness import loadgen
from bench.harness.machine import describe_machine
from bench.harness.report import markdown_table
from bench.harness.stack import make_api_keys, new_queue, simulated_env, simulated_stack
from bench.harness.stats import median
from bench.harness.trees import in_turn
from devstack.embedded_redis import EmbeddedRedis
from devstack.stack import Stack
from workers.samplers.simulated import expected_completion

CALL_MS = 100
MAX_BATCH = 100
UPLOAD_AFTER_S = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=5)
    # 12 s: the default SAMPLING_UPLOAD_BYTES_PER_S (16 MiB/s) reads 150 MB in about 9.4 s.
    parser.add_argument("--seconds", type=float, default=12.0, help="per window, default 12")
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


def _window(stack: Stack, rate: float, seconds: float, upload: Path | None, tag: str) -> float:
    """The p99 (ms) of the 200s of one window, with `upload` sent during it (or none)."""
    uploaded: list[float] = []

    def send() -> None:
        time.sleep(UPLOAD_AFTER_S)  # duration: the window's requests under way first
        began = time.monotonic()
        done = subprocess.run(
            ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "600",
             "-H", f"Authorization: Bearer {stack.env['BENCH_KEY']}", "-F", "purpose=batch",
             "-F", f"file=@{upload}", f"{stack.base_url}/v1/files"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        uploaded.append(time.monotonic() - began)
        if done.stdout != "200":
            raise RuntimeError(f"the upload got {done.stdout}: {done.stderr}")

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
    upload = Path(tempfile.mkdtemp(prefix="bench-upload-")) / "big.jsonl"
    upload.write_bytes(jsonl(args.megabytes, env["SAMPLING_QUEUE"]))
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
        upload.unlink(missing_ok=True)
    table = [[f"{i + 1}", f"{a:.1f}", f"{b:.1f}", f"{d:+.1f}"] for i, (a, b, d) in enumerate(rows)]
    table.append(["median", *(f"{median([row[k] for row in rows]):.1f}" for k in range(2)),
                  f"{median([row[2] for row in rows]):+.1f}"])  # fmt: skip
    print(f"\n{args.megabytes} MB upload; /sample at {args.load}% of one simulated GPU's limit "
          f"({rate:g}/s), {args.seconds:g} s windows\n")  # fmt: skip
    print(markdown_table(["round", "p99 ms without", "p99 ms with upload", "difference"], table))
