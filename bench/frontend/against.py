"""Parts 1 and 2 of the front-end benchmark for this tree and an older commit, alternating
(`python -m bench frontend --against REF`)."""

from __future__ import annotations

import contextlib
import statistics

import redis

from bench.frontend.client import closed_loop, single_latencies_ms
from bench.harness.procstat import cpu_seconds, redis_commands
from bench.harness.report import markdown_table
from bench.harness.stack import Stack, make_api_keys, new_queue, simulated_env, simulated_stack
from bench.harness.trees import in_turn, trees
from devstack.embedded_redis import EmbeddedRedis


def limited_key(stack: Stack) -> str:
    """A key with a request limit no run reaches (every request raises its counter)."""
    return make_api_keys(stack, {"bench": ["--rpm", "100000000"]})["bench"]


def compare(ref: str, rounds: int, cpu_requests: int, sequential: int) -> None:
    """Parts 1 and 2 for this tree and `ref`, a fresh service for each, alternating."""
    figures: dict[str, dict[str, list[float]]] = {}
    with contextlib.ExitStack() as resources:
        versions = trees(resources, ref)
        server = EmbeddedRedis().start()
        resources.callback(server.stop)
        for round_number in range(rounds):
            for tree in in_turn(versions, round_number):
                env = simulated_env(server.url, new_queue("bench-cmp"), log_level=None)
                stack = simulated_stack(env, [None], root=tree.root)
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
                    if tree.is_this:  # this tree has API keys: also a rate-limited key
                        headers = {"Authorization": f"Bearer {limited_key(stack)}"}
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
    header = ["code", "single request p50 (ms)", "CPU per /sample (ms)", "CPU per bare view (ms)"]
    cells = [
        [name, *(f"{statistics.median(row[k]):.2f}" for k in ("p50", "sample", "bare"))]
        for name, row in figures.items()
    ]
    print(markdown_table(header, cells))
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
