"""Front-end CPU per request with routing by model: one model, and a request spread over 3.

    .venv/bin/python -m bench routing --against REF [--rounds 10] [--stacks 2] [--rate 400]

Four cases of simulated stacks (3 CPU workers standing for 3 GPUs, 2 gevent web processes
each), `--stacks` stacks per case, all on one embedded Redis, each stack in a database of its
own (the versions' published API keys differ in wording, and in one database their
housekeeping would republish each other's), all started first and kept up, so that every case
meets the machine as it is at the same minutes:

- `REF` and `REF (A/A)`: stacks of the older tree, to show how far two cases of the same code
  read apart on this machine;
- `this, 1 model`: this tree serving one model (SAMPLING_QUEUE);
- `this, 3 models`: this tree serving three (SAMPLING_MODELS, a worker each), each request
  naming one of them in turn.

The same three workers in every case keep the batches alike (a batch per worker per call,
each a third of the requests): CPU per request then differs by what routing costs, not by
how full the batches are.

A round gives each stack in turn (the order reversed every other round) `--seconds` of
`--rate` /v1/completions requests per second (one prompt, the openai client's body; every
answer checked), then as many /sample requests, open loop, constant arrivals, by the
harness's generator, each after half a second of warm-up; a stack's figure is its web
processes' CPU (from /proc) over its requests, a case's the mean of its stacks'. Short turns
in many rounds, not one long run per stack, so that the machine's slow drifts (a noisy
neighbour, the clock) fall on every case alike: the change against REF is the median over
the rounds of each round's ratio, and the A/A row shows the spread of that statistic. Several
stacks per case, because one stack reads a few percent above or below another of the same
code for the whole run (measured: two stacks of one tree 5% apart over 10 rounds), and a case
of one stack would carry that as its own. It also prints, with one model's worker stopped in
a 3-model stack, how fast a request for that model gets its 503.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import itertools
import json
import statistics
import time
from collections import Counter

from bench.harness import loadgen
from bench.harness.machine import describe_machine
from bench.harness.procstat import cpu_seconds
from bench.harness.report import markdown_table
from bench.harness.stack import Stack, new_queue, simulated_env, simulated_stack
from bench.harness.trees import THIS, Tree, in_turn, worktree
from devstack.embedded_redis import EmbeddedRedis
from workers.samplers.simulated import expected_completion

MODELS = 3
PATHS = ("/v1/completions", "/sample")
WARM_UP_S = 0.5
# A turn with more requests than this not answered right (a wrong answer, an error, a late
# one) is a hiccup of the machine: its round is dropped for every case, and said. Over
# BROKEN_SHARE, the stack is broken, not slow: the benchmark stops.
MAX_BAD_SHARE = 0.01
BROKEN_SHARE = 0.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--against", required=True, help="the git ref before routing")
    parser.add_argument("--rounds", type=int, default=10, help="default 10")
    parser.add_argument("--stacks", type=int, default=2, help="stacks per case, default 2")
    parser.add_argument("--rate", type=float, default=400.0, help="req/s per path, default 400")
    parser.add_argument("--seconds", type=float, default=4.0, help="per path and turn, default 4")


def _protocol(models: list[str]) -> loadgen.Protocol:
    """/v1/completions with one prompt, naming the models in turn."""
    turn = itertools.cycle(models)

    def body(prompt: str) -> bytes:
        return json.dumps({"model": next(turn), "prompt": prompt}).encode()

    def answer(raw: bytes) -> str:
        return str(json.loads(raw)["choices"][0]["text"])

    return loadgen.Protocol("application/json", body, answer)


def _measure(
    stack: Stack, models: list[str], rate: float, seconds: float
) -> dict[str, float] | None:
    """CPU ms per request of the stack's web processes, per path, over one turn (None: too
    many requests not answered right)."""
    assert stack.web is not None
    found = {}
    for path in PATHS:
        protocol = _protocol(models) if path != "/sample" else None
        # Warm-up first: the stack was idle while the others were measured.
        for duration, counted in ((WARM_UP_S, False), (seconds, True)):
            before = cpu_seconds(stack.web.pid)
            results = loadgen.run(
                "127.0.0.1", stack.port, path, rate, duration,
                prompt=lambda i: f"routing {i}", expected=expected_completion,
                protocol=protocol, constant=True,
            )  # fmt: skip
            used = cpu_seconds(stack.web.pid) - before
            if counted:
                bad = Counter(o for o in results.outcomes if o != "ok")
                if sum(bad.values()) > len(results.outcomes) * BROKEN_SHARE:
                    raise SystemExit(f"requests not answered right on {path}: {dict(bad)}")
                if bad:
                    print(f"  ({path}: {dict(bad)} of {len(results.outcomes)})", flush=True)
                if sum(bad.values()) > len(results.outcomes) * MAX_BAD_SHARE:
                    return None
                found[path] = used / len(results.outcomes) * 1000
    return found


def _refusals_ms(stack: Stack, model: str, count: int = 100) -> list[float]:
    """Stop `model`'s worker (SIGTERM: its goodbye), then time `count` sequential requests
    for it once they are refused: how fast a model without a worker gets its 503."""
    index = next(i for i, m in enumerate(stack.worker_models) if m and m[0] == model)
    stack.stop_process(stack.workers[index])
    body = json.dumps({"model": model, "prompt": "anyone?"}).encode()
    headers = {"Content-Type": "application/json"}
    times: list[float] = []
    give_up = time.monotonic() + 30
    while len(times) < count and time.monotonic() < give_up:
        connection = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=10)
        started = time.perf_counter()
        connection.request("POST", "/v1/completions", body=body, headers=headers)
        response = connection.getresponse()
        response.read()
        elapsed = (time.perf_counter() - started) * 1000
        connection.close()
        if response.status == 503:
            times.append(elapsed)
    return times


def _case(tree: Tree, redis_url: str, models: int) -> tuple[Stack, list[str]]:
    names = [new_queue("route") for _ in range(models)]
    env = simulated_env(redis_url, names[0], log_level=None)
    if models > 1:  # a worker per model
        env["SAMPLING_MODELS"] = ",".join(names)
        return simulated_stack(env, [None], root=tree.root), names
    # As many workers as the models of the other case: the same GPUs, so the same batches
    # per second and the same fill, whether they serve one model or three.
    return simulated_stack(env, [None] * MODELS, root=tree.root), names


def main(args: argparse.Namespace) -> None:
    print(describe_machine(), flush=True)
    figures: dict[str, dict[str, list[float]]] = {}
    with contextlib.ExitStack() as resources:
        before = Tree(args.against[:8], resources.enter_context(worktree(args.against)))
        server = EmbeddedRedis().start()
        resources.callback(server.stop)
        plan = (
            (before.name, before, 1),
            (f"{before.name} (A/A)", before, 1),
            ("this, 1 model", THIS, 1),
            (f"this, {MODELS} models", THIS, MODELS),
        )
        # The cases' stacks interleaved (case by case, then again): (case, stack, models)
        stacks: list[tuple[str, Stack, list[str]]] = []
        for _ in range(args.stacks):
            for name, tree, models in plan:
                database = f"{server.url.rsplit('/', 1)[0]}/{len(stacks)}"
                stack, names = _case(tree, database, models)
                resources.callback(stack.stop)
                stack.start(timeout_s=120)
                stacks.append((name, stack, names))
        for round_number in range(args.rounds):
            measured: dict[str, list[dict[str, float]]] = {}
            for name, stack, names in in_turn(stacks, round_number):
                found = _measure(stack, names, args.rate, args.seconds)
                if found is None:
                    print(f"  round {round_number + 1} dropped: {name} had a hiccup", flush=True)
                    break
                measured.setdefault(name, []).append(found)
                shown = ", ".join(f"{path} {value:.3f}" for path, value in found.items())
                print(f"  round {round_number + 1} {name}: {shown} ms", flush=True)
            if found is None:
                continue
            for name, per_stack in measured.items():
                row = figures.setdefault(name, {path: [] for path in PATHS})
                for path in PATHS:
                    row[path].append(statistics.mean(found[path] for found in per_stack))
        _, stack, names = next(s for s in stacks if s[0] == plan[-1][0])
        refusals = sorted(_refusals_ms(stack, names[-1]))
    report(figures, before.name, args)
    print(
        f"\nA model without a live worker (its worker stopped), {len(refusals)} sequential "
        f"/v1/completions: 503 in p50 {statistics.median(refusals):.1f} ms, p99 "
        f"{refusals[int(len(refusals) * 0.99) - 1]:.1f} ms, max {refusals[-1]:.1f} ms"
    )


def report(figures: dict[str, dict[str, list[float]]], base: str, args: argparse.Namespace) -> None:
    """Each case's median CPU per request, and its change against `base`: the median of the
    rounds' ratios (each round's figure against `base`'s in the same round)."""
    print(
        f"\nFront-end CPU per request (ms, medians of {len(figures[base][PATHS[0]])} of "
        f"{args.rounds} alternating rounds, "
        f"{args.stacks} stacks per case, {args.rate:g} req/s per path for {args.seconds:g} s a "
        "turn)\n"
    )
    cells = []
    for name, row in figures.items():
        medians = [f"{statistics.median(row[path]):.3f}" for path in PATHS]
        changes = [
            statistics.median(a / b for a, b in zip(row[path], figures[base][path], strict=True))
            for path in PATHS
        ]
        cells.append([name, *medians, *(f"{change - 1:+.1%}" for change in changes)])
    header = ["case", *PATHS, *(f"{path} vs {base}" for path in PATHS)]
    print(markdown_table(header, cells))
