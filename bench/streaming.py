"""Streams under load: time to first token, between tokens, goodput at 50, 90, 150% of the limit.

    .venv/bin/python -m bench streaming [--seconds 10] [--max-batch 10] [--call-ms 100]
        [--cost contract|h100-graphs-135m|FILE]
    .venv/bin/python -m bench streaming --sampler hf --rates 10,50,200   # the real model

`--sampler hf`: the packaged SmolLM2 in one worker on this machine's first GPU (its CPU
without one), `--max-tokens` a completion, at the `--rates` given (streams a second): its
limit is not known beforehand, its text not either (a stream is good when it ends with
`data: [DONE]` and some text), and the whole answers' run is left out (`make gpu-report`).

One simulated GPU (calls of `--call-ms` whatever their size, up to `--max-batch` prompts, 16
words a completion) behind two gevent web processes, on an embedded Redis: its limit is
max-batch / call streams a second. `--cost` prices its calls on a cost profile instead
(batching.call_cost): a call of 16-word streams lasts what its rows cost, and the limit is a
full call's. At each load, `--seconds` of open-loop constant arrivals of
streaming /v1/completions (one prompt, `stream: true`), each on a connection of its own, read
as they come by the harness's streaming client. Per load:

- goodput: streams a second that ended with `data: [DONE]` and exactly their text;
- time to first token, p50 and p99: from each stream's intended send time (a late send
  counts against it) to its first content chunk;
- inter-token latency, p50 and p99: between two content chunks of a stream;
- Redis commands per stream, and the same load of whole answers (`stream: false`) beside it:
  what streaming adds, per stream and per delta message (PUBLISHes beyond one per batch).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from batching.call_cost import CONTRACT, Shape, load_profile
from bench.harness.machine import describe_machine
from bench.harness.procstat import redis_commands
from bench.harness.report import markdown_table
from bench.harness.sse import Timeline, stream
from bench.harness.stack import new_queue, simulated_env, simulated_stack
from bench.harness.stats import percentile
from devstack.embedded_redis import EmbeddedRedis
from workers.launch import local_gpu_count
from workers.samplers.simulated import expected_completion

EXTRA_WORDS = 10  # 16 words a completion
LOADS = (0.5, 0.9, 1.5)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=10.0, help="per load, default 10")
    parser.add_argument("--max-batch", type=int, default=10, help="default 10")
    parser.add_argument("--call-ms", type=int, default=100, help="simulated: default 100")
    parser.add_argument("--sampler", choices=("simulated", "hf"), default="simulated")
    parser.add_argument("--rates", help="hf: streams a second, comma-separated (10,50,200)")
    parser.add_argument("--max-tokens", type=int, default=32, help="a completion's, default 32")
    parser.add_argument("--cost", default=CONTRACT, help="simulated: a cost profile (contract)")


@dataclass(frozen=True)
class _Setup:
    """A run's stack settings, loads (label, streams a second), what a good stream's text
    is (None: any text), and how long a stream may take."""

    env: dict[str, str]
    gpus: list[int | None]
    loads: list[tuple[str, float]]
    expected: Callable[[str], str] | None
    timeout_s: float
    whole: bool  # also the same loads of whole answers, for Redis' commands


def _setup(args: argparse.Namespace, redis_url: str, queue: str) -> _Setup:
    if args.sampler == "simulated":
        limit = args.max_batch / (_call_ms(args) / 1000)
        env = simulated_env(redis_url, queue, call_ms=args.call_ms, max_batch=args.max_batch,
                            SIMULATED_EXTRA_WORDS=str(EXTRA_WORDS),
                            SIMULATED_COST=args.cost)  # fmt: skip
        loads = [(f"{share:.0%} ({limit * share:g}/s)", limit * share) for share in LOADS]
        return _Setup(env, [None], loads, lambda p: expected_completion(p, EXTRA_WORDS), 5, True)
    if not args.rates:
        raise SystemExit("--sampler hf needs --rates (streams a second, e.g. 10,50,200)")
    deadline_ms = 60_000  # a CPU's calls take seconds: what arrives is measured, not refused
    env = simulated_env(
        redis_url, queue, max_batch=args.max_batch, deadline_ms=deadline_ms, SAMPLER="hf",
        SAMPLING_MODEL="", SAMPLING_MAX_NEW_TOKENS=str(args.max_tokens),
        SAMPLING_CALL_TIMEOUT_MS=str(deadline_ms),
    )  # fmt: skip
    loads = [(f"{float(rate):g}/s", float(rate)) for rate in args.rates.split(",")]
    gpus: list[int | None] = [0] if local_gpu_count() else [None]
    return _Setup(env, gpus, loads, None, deadline_ms / 1000 + 5, False)


def _call_ms(args: argparse.Namespace) -> float:
    """A full call of 16-word completions: `--call-ms`, or its profile's time."""
    profile = load_profile(args.cost, args.call_ms)
    return profile.call_ms(Shape(args.max_batch, 3, min(args.max_tokens, 16)))


def _request(port: int, model: str, prompt: str, streaming: bool, max_tokens: int) -> bytes:
    body = json.dumps(
        {"model": model, "prompt": prompt, "stream": streaming, "max_tokens": max_tokens}
    )
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
    ).encode()


async def _load(
    port: int, model: str, rate: float, seconds: float, streaming: bool, tag: str,
    setup: _Setup, max_tokens: int,
) -> list[tuple[float, str, Timeline | None]]:  # fmt: skip
    """Constant arrivals of `rate` a second for `seconds`: (intended send, prompt, timeline)
    for each (None: no answer at all)."""
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.05
    found: list[tuple[float, str, Timeline | None]] = []

    async def one(intended: float, prompt: str) -> None:
        request = _request(port, model, prompt, streaming, max_tokens)
        try:
            answer = stream("127.0.0.1", port, request) if streaming else _whole(port, request)
            timeline: Timeline | None = await asyncio.wait_for(answer, timeout=setup.timeout_s)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError):
            timeline = None
        found.append((intended, prompt, timeline))  # the loop's clock is time.monotonic

    tasks = []
    for index in range(round(rate * seconds)):
        intended = start + index / rate
        if intended > loop.time():
            await asyncio.sleep(intended - loop.time())
        tasks.append(asyncio.ensure_future(one(intended, f"{tag} {index}")))
    await asyncio.gather(*tasks)
    return found


async def _whole(port: int, request: bytes) -> Timeline:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        body = await reader.readexactly(length)
        status = int(head.split(b" ", 2)[1])
        if status != 200:  # a refusal (503 at 150% of the limit): no text
            return Timeline(status)
        return Timeline(status, [json.loads(body)["choices"][0]["text"]], [], True)
    finally:
        writer.close()


def _publishes(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_publish", {}).get("calls", 0))


def _ms(values: list[float], q: float) -> str:
    return f"{percentile(values, q) * 1000:.1f}" if values else "-"


def main(args: argparse.Namespace) -> None:
    print(describe_machine(), flush=True)
    server = EmbeddedRedis().start()
    client = redis.Redis.from_url(server.url)
    queue = new_queue("streaming")
    setup = _setup(args, server.url, queue)
    stack = simulated_stack(setup.env, setup.gpus)
    try:
        stack.start(timeout_s=300)
        assert stack.port is not None

        def load(rate: float, seconds: float, streaming: bool, tag: str) -> list[Any]:
            return asyncio.run(_load(stack.port or 0, queue, rate, seconds, streaming, tag,
                                     setup, args.max_tokens))  # fmt: skip

        load(setup.loads[0][1] * 0.5, 2, True, "warm")
        rows = [_row(args, setup, client, load, label, rate) for label, rate in setup.loads]
    finally:
        stack.stop()
        server.stop()
    if setup.whole:
        calls = (
            f"{args.call_ms} ms calls"
            if args.cost == CONTRACT
            else (f"calls on the {args.cost} curve ({_call_ms(args):.1f} ms full)")
        )
        print(f"\nStreams of 16 words, one simulated GPU: {calls} of up to "
              f"{args.max_batch}, {args.seconds:g} s per load\n")  # fmt: skip
    else:
        where = "a GPU" if setup.gpus != [None] else "the CPU"
        print(f"\nStreams of up to {args.max_tokens} tokens, the packaged SmolLM2 on {where}, "
              f"calls of up to {args.max_batch}, {args.seconds:g} s per load\n")  # fmt: skip
    header = ["load", "goodput/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
              "Redis cmds/stream", "cmds/whole answer", "delta msgs/stream",
              "added cmds/delta msg"]  # fmt: skip
    print(markdown_table(header, rows))


def _row(
    args: argparse.Namespace,
    setup: _Setup,
    client: redis.Redis,
    load: Callable[[float, float, bool, str], list[Any]],
    label: str,
    rate: float,
) -> list[str]:
    """One load's row: streams, then (simulated) the same load of whole answers."""
    commands, published = {}, {}
    streams: list[tuple[float, str, Timeline | None]] = []
    for streaming in (True, False) if setup.whole else (True,):
        before, publishes = redis_commands(client), _publishes(client)
        found = load(rate, args.seconds, streaming, f"{'s' if streaming else 'w'}{rate:g}")
        commands[streaming] = (redis_commands(client) - before) / len(found)
        published[streaming] = (_publishes(client) - publishes) / len(found)
        if streaming:
            streams = found
    expected = setup.expected
    good = [t for _, p, t in streams
            if t and t.done and t.text and (expected is None or t.text == expected(p))]  # fmt: skip
    ttft = [t.arrivals[0] - start for start, _, t in streams if t and t.done and t.arrivals]
    itl = [b - a for t in good for a, b in zip(t.arrivals, t.arrivals[1:], strict=False)]
    whole, deltas, added = "-", "-", "-"
    if setup.whole:  # the whole answers' run publishes each batch's answers alone
        delta_msgs = max(0.0, published[True] - published[False])
        whole, deltas = f"{commands[False]:.1f}", f"{delta_msgs:.1f}"
        if delta_msgs:
            added = f"{(commands[True] - commands[False]) / delta_msgs:.2f}"
    row = [label, f"{len(good) / args.seconds:.1f}", _ms(ttft, 50), _ms(ttft, 99), _ms(itl, 50),
           _ms(itl, 99), f"{commands[True]:.1f}", whole, deltas, added]  # fmt: skip
    print(f"  {row}", flush=True)
    return row
