"""Front-end figures of the batching service, measured on real processes in one run.

    .venv/bin/python -m bench.frontend [--quick]
    .venv/bin/python -m bench.frontend --against e921270   # parts 1 and 2, this tree against
                                                           # an older commit, alternating

Starts its own Redis (embedded unless REDIS_URL is set), Celery worker(s) with the simulated
sampler and gunicorn, then measures and prints a markdown table of:
  1. single-request latency (sequential requests) against SIMULATED_BATCH_MS;
  2. front-end CPU ms per request (gunicorn master + workers, from /proc) on the full
     /sample path, on /v1/completions with one prompt (JSON in and out, as the openai client
     sends it), and on a bare Django view served the same way (/healthz), same load;
  3. the deadline's accuracy: 504 latency minus the deadline, sequential, with no worker;
  4. simultaneous waits one node (2 processes) holds: N requests sent over 1.5 s to a queue
     with no worker and a 3 s deadline, so that all N wait at once, for gevent (the
     default) and gthread (GUNICORN_CMD_ARGS); each should get its 504 at the deadline.
     Latencies are seen by the client, which runs on the same 2 cores.
Rounds alternate between the compared cases and medians are reported: the machine is noisy.
"""

from __future__ import annotations

from gevent import monkey

monkey.patch_all()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import http.client  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402

import gevent  # noqa: E402
import redis  # noqa: E402
from gevent.pool import Pool  # noqa: E402

from batching.access import POLL_INTERVAL_S  # noqa: E402
from bench import loadgen  # noqa: E402
from bench.compare import redis_commands  # noqa: E402
from bench.gap import Tree, worktree  # noqa: E402
from bench.procstat import cpu_seconds  # noqa: E402
from inference_site.lib.embedded_redis import EmbeddedRedis  # noqa: E402
from inference_site.lib.stack import ROOT, Stack  # noqa: E402
from workers.samplers.simulated import expected_completion  # noqa: E402

COMPLETIONS = "/v1/completions"
# The endpoints measured with a prompt; the model left to its default, as clients may.
PROTOCOLS = {"/sample": loadgen.RAW_TEXT, COMPLETIONS: loadgen.completions_protocol()}


def one(
    base_port: int,
    path: str,
    body: bytes | None,
    timeout: float = 30,
    headers: dict[str, str] | None = None,
) -> tuple[int, str, float]:
    connection = http.client.HTTPConnection("127.0.0.1", base_port, timeout=timeout)
    try:
        started = time.perf_counter()
        method = "POST" if body is not None else "GET"
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        data = response.read().decode("utf-8", "replace")
        return response.status, data, time.perf_counter() - started
    except OSError as exc:
        return 0, str(exc), time.perf_counter() - started
    finally:
        connection.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def closed_loop(
    port: int,
    path: str,
    requests: int,
    concurrency: int,
    check: bool,
    headers: dict[str, str] | None = None,
) -> float:
    """Send `requests` requests with `concurrency` in flight; return wall seconds."""
    pool = Pool(concurrency)
    errors: list[str] = []

    def task(i: int) -> None:
        prompt = f"bench {i} {uuid.uuid4().hex[:8]}"
        protocol = PROTOCOLS.get(path)  # None: a GET of a bare view
        payload = protocol.body(prompt) if protocol else None
        status, body, _ = one(port, path, payload, headers=headers)
        text = protocol.answer(body.encode()) if protocol and status == 200 else None
        wrong = check and text is not None and text != expected_completion(prompt)
        if status != 200 or wrong:
            errors.append(f"{status} {body[:80]}")

    started = time.perf_counter()
    pool.map(task, range(requests))
    if errors:
        raise SystemExit(f"{len(errors)} bad answers on {path}, e.g. {errors[:3]}")
    return time.perf_counter() - started


def single_latencies_ms(port: int, count: int) -> list[float]:
    latencies = []
    for i in range(count):
        prompt = f"single {i} {uuid.uuid4().hex[:6]}"
        status, body, seconds = one(port, "/sample", prompt.encode())
        assert (status, body) == (200, expected_completion(prompt)), (status, body)
        latencies.append(seconds * 1000)
    return latencies


def _limited_key(stack: Stack) -> str:
    """A key with a request limit no run reaches (every request raises its counter), made as
    an operator makes one, once every web process has it."""
    # In the stack's own database (Stack.own_database): the web processes republish its keys.
    made = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "createapikey", "bench", "--rpm", "100000000"],
        env=stack.environment(), capture_output=True, text=True, check=True,
    )  # fmt: skip
    key = made.stdout.strip().splitlines()[-1]
    time.sleep(2 * POLL_INTERVAL_S + 0.5)
    return key


def compare(ref: str, rounds: int, cpu_requests: int, sequential: int) -> None:
    """Parts 1 and 2 for this tree and `ref`, a fresh service for each, alternating."""
    figures: dict[str, dict[str, list[float]]] = {}
    with contextlib.ExitStack() as resources:
        trees = [Tree(ref[:8], resources.enter_context(worktree(ref))), Tree("this", ROOT)]
        server = EmbeddedRedis().start()
        resources.callback(server.stop)
        for round_number in range(rounds):
            for tree in trees if round_number % 2 == 0 else trees[::-1]:
                queue = f"bench-cmp-{uuid.uuid4().hex[:6]}"
                env = {"REDIS_URL": server.url, "SAMPLER": "simulated", "SAMPLING_QUEUE": queue,
                       "DJANGO_SECRET_KEY": "bench-only-" + uuid.uuid4().hex}  # fmt: skip
                stack = Stack(env=env, gpus=[None], web_processes=2, root=tree.root,
                              log_dir=Path("/tmp") / f"bench-{queue}",
                              own_database=True)  # fmt: skip
                try:
                    stack.start(timeout_s=120)
                    assert stack.web is not None
                    row = figures.setdefault(tree.name, {"p50": [], "sample": [], "bare": []})
                    row["p50"].append(
                        statistics.median(single_latencies_ms(stack.port, sequential))
                    )
                    for path, name in (("/healthz", "bare"), ("/sample", "sample")):
                        cpu_before = cpu_seconds(stack.web.pid)
                        closed_loop(stack.port, path, cpu_requests, 50, check=True)
                        used = cpu_seconds(stack.web.pid) - cpu_before
                        row[name].append(used / cpu_requests * 1000)
                    if tree.root == ROOT:  # this tree has API keys: also a rate-limited key
                        headers = {"Authorization": f"Bearer {_limited_key(stack)}"}
                        client = redis.Redis.from_url(server.url)
                        commands_before = redis_commands(client)
                        cpu_before = cpu_seconds(stack.web.pid)
                        closed_loop(stack.port, "/sample", cpu_requests, 50, True, headers)
                        used = cpu_seconds(stack.web.pid) - cpu_before
                        commands = redis_commands(client) - commands_before
                        row.setdefault("keyed", []).append(used / cpu_requests * 1000)
                        row.setdefault("keyed commands", []).append(commands / cpu_requests)
                finally:
                    stack.stop()
                shown = ", ".join(f"{key} {values[-1]:.2f}" for key, values in row.items())
                print(f"  round {round_number + 1} {tree.name}: {shown}", flush=True)
    print(f"\nFront end, this tree against {ref} (median of {rounds} rounds, alternating)\n")
    print("| code | single request p50 (ms) | CPU per /sample (ms) | CPU per bare view (ms) |")
    print("|---|---:|---:|---:|")
    for name, row in figures.items():
        cells = [f"{statistics.median(row[k]):.2f}" for k in ("p50", "sample", "bare")]
        print(f"| {name} | " + " | ".join(cells) + " |")
    keyed = figures["this"]
    if "keyed" in keyed:
        print(
            f"\nThis tree, /sample with a rate-limited API key (same rounds): "
            f"{statistics.median(keyed['keyed']):.2f} ms CPU per request, "
            f"{statistics.median(keyed['keyed commands']):.2f} Redis commands per request "
            "(all of the node's, closed loop)"
        )
    before, after = figures[ref[:8]], figures["this"]
    for key, label in (("p50", "single request p50"), ("sample", "CPU per /sample")):
        change = statistics.median(after[key]) / statistics.median(before[key]) - 1
        print(f"\n{label}: {change:+.1%} against {ref}", end="")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny run (smoke test)")
    parser.add_argument(
        "--cpu-only", action="store_true", help="only the front-end CPU per request (part 2)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of part 2 (default 3)")
    parser.add_argument("--against", help="a git ref: parts 1 and 2 for it and this tree")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    cpu_requests = 100 if args.quick else 1000
    sequential = 10 if args.quick else 100
    if args.against:
        return compare(args.against, rounds, cpu_requests, sequential)
    waits = 150 if args.quick else 3000
    batch_ms = int(os.environ.get("SIMULATED_BATCH_MS", "100"))
    deadline_ms = int(os.environ.get("SAMPLING_DEADLINE_MS", "500"))

    redis_server = None
    redis_url = os.environ.get("REDIS_URL")
    if not redis_url:
        redis_server = EmbeddedRedis().start()
        redis_url = redis_server.url
    base_env = {"REDIS_URL": redis_url, "SAMPLER": "simulated"}
    rows: list[tuple[str, str]] = []
    stacks: list[Stack] = []

    def start(label: str, gpus: list[int | None], **env: str) -> Stack:
        queue = f"bench-{label}-{uuid.uuid4().hex[:6]}"
        stack = Stack(env={**base_env, "SAMPLING_QUEUE": queue, **env}, gpus=gpus,
                      web_processes=2, log_dir=Path("/tmp") / f"bench-{queue}",
                      own_database=True)  # fmt: skip
        stacks.append(stack)
        return stack.start(timeout_s=120)

    try:
        service = start("sim", [None])
        assert service.web is not None
        # 1. single-request latency
        latencies = []
        for i in range(sequential):
            prompt = f"single {i}"
            status, body, seconds = one(service.port, "/sample", prompt.encode())
            assert (status, body) == (200, expected_completion(prompt))
            latencies.append(seconds * 1000)
        p50 = statistics.median(latencies)
        rows.append(("single request latency p50 (ms)", f"{p50:.1f}"))
        rows.append(("single request latency p95 (ms)", f"{percentile(latencies, 95):.1f}"))
        rows.append(("p50 minus SIMULATED_BATCH_MS (ms)", f"{p50 - batch_ms:+.1f}"))

        # 2. front-end CPU per request, full path vs bare view vs the OpenAI-compatible
        # endpoint (one prompt), alternating rounds
        paths = ("/healthz", "/sample", COMPLETIONS)
        per_request: dict[str, list[float]] = {path: [] for path in paths}
        rates: dict[str, list[float]] = {path: [] for path in paths}
        for _ in range(rounds):
            for path in paths:
                before = cpu_seconds(service.web.pid)
                wall = closed_loop(service.port, path, cpu_requests, 50, check=True)
                used = cpu_seconds(service.web.pid) - before
                per_request[path].append(used / cpu_requests * 1000)
                rates[path].append(cpu_requests / wall)
        full = statistics.median(per_request["/sample"])
        bare = statistics.median(per_request["/healthz"])
        rows.append(("front-end CPU per request, /sample (ms)", f"{full:.2f}"))
        rows.append(("front-end CPU per request, bare view /healthz (ms)", f"{bare:.2f}"))
        rows.append(("ratio full path / bare view", f"{full / bare:.2f}"))
        api = statistics.median(per_request[COMPLETIONS])
        rows.append((f"front-end CPU per request, {COMPLETIONS} one prompt (ms)", f"{api:.2f}"))
        rows.append((f"ratio {COMPLETIONS} / /sample", f"{api / full:.2f}"))
        rows.append(("  (/sample throughput in that test, req/s)",
                     f"{statistics.median(rates['/sample']):.0f}"))  # fmt: skip
        if args.cpu_only:
            return report(rows, batch_ms, deadline_ms, rounds)

        # 3. deadline accuracy: sequential requests on a queue with no worker
        idle = start("idle", [])
        one(idle.port, "/sample", b"warm-up", 60)
        errors = []
        for i in range(sequential // 2):
            status, _, seconds = one(idle.port, "/sample", f"alone {i}".encode(), 60)
            assert status == 504, status
            errors.append((seconds - deadline_ms / 1000) * 1000)
        rows.append(("504 minus deadline, sequential, p50 / p99 / max (ms)",
                     f"{percentile(errors, 50):.1f} / {percentile(errors, 99):.1f}"
                     f" / {max(errors):.1f}"))  # fmt: skip
        idle.stop()

        # 4. simultaneous waits held by one node (2 processes), no worker: requests arrive
        # over 1.5 s and wait for a 3 s deadline, so all of them are waiting at once; each
        # should get its 504 at the deadline.
        hold_deadline_ms = 3000
        for worker_class, extra in (
            ("gevent", {}),
            ("gthread 64 threads", {"GUNICORN_CMD_ARGS": "--worker-class gthread --threads 64"}),
        ):
            idle = start("hold", [], SAMPLING_DEADLINE_MS=str(hold_deadline_ms), **extra)
            one(idle.port, "/sample", b"warm-up", 60)
            for concurrency in (waits // 3, waits):
                spacing = 1.5 / concurrency
                results: list[tuple[int, str, float]] = []

                greenlets = []
                started = time.perf_counter()
                for i in range(concurrency):
                    gevent.sleep(max(0.0, started + i * spacing - time.perf_counter()))
                    greenlets.append(
                        gevent.spawn(one, idle.port, "/sample", f"wait {i}".encode(), 60)
                    )
                gevent.joinall(greenlets)
                results.extend(g.value for g in greenlets)
                late = sorted(
                    (seconds - hold_deadline_ms / 1000) * 1000
                    for status, _, seconds in results
                    if status == 504
                )
                label = f"{worker_class}, {concurrency} simultaneous waits"
                rows.append((f"{label}: 504s / past deadline p50 / p99 / max (ms)",
                             f"{len(late)}/{concurrency} / {percentile(late, 50):.0f} / "
                             f"{percentile(late, 99):.0f} / {late[-1]:.0f}"))  # fmt: skip
                gevent.sleep(1)
            idle.stop()
    finally:
        for stack in stacks:
            stack.stop()
        if redis_server is not None:
            redis_server.stop()

    report(rows, batch_ms, deadline_ms, rounds)


def report(rows: list[tuple[str, str]], batch_ms: int, deadline_ms: int, rounds: int) -> None:
    print(f"\nMachine: {os.cpu_count()} cores; SIMULATED_BATCH_MS={batch_ms}, "
          f"SAMPLING_DEADLINE_MS={deadline_ms}; medians of {rounds} round(s)\n")  # fmt: skip
    print("| measure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
