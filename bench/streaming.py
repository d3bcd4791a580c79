"""Streams under load: time to first token, between tokens, goodput at 50, 90, 150% of the limit.

    .venv/bin/python -m bench streaming [--seconds 10] [--max-batch 10] [--call-ms 100]

One simulated GPU (calls of `--call-ms` whatever their size, up to `--max-batch` prompts, 16
words a completion) behind two gevent web processes, on an embedded Redis: its limit is
max-batch / call streams a second. At each load, `--seconds` of open-loop constant arrivals of
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

import redis

from bench.harness.machine import describe_machine
from bench.harness.procstat import redis_commands
from bench.harness.report import markdown_table
from bench.harness.sse import Timeline, stream
from bench.harness.stack import new_queue, simulated_env, simulated_stack
from bench.harness.stats import percentile
from inference_site.lib.embedded_redis import EmbeddedRedis
from workers.samplers.simulated import expected_completion

EXTRA_WORDS = 10  # 16 words a completion
LOADS = (0.5, 0.9, 1.5)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=10.0, help="per load, default 10")
    parser.add_argument("--max-batch", type=int, default=10, help="default 10")
    parser.add_argument("--call-ms", type=int, default=100, help="default 100")


def _request(port: int, model: str, prompt: str, streaming: bool) -> bytes:
    body = json.dumps({"model": model, "prompt": prompt, "stream": streaming, "max_tokens": 32})
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
    ).encode()


async def _load(
    port: int, model: str, rate: float, seconds: float, streaming: bool, tag: str
) -> list[tuple[float, str, Timeline | None]]:
    """Constant arrivals of `rate` a second for `seconds`: (intended send, prompt, timeline)
    for each (None: no answer at all)."""
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.05
    found: list[tuple[float, str, Timeline | None]] = []

    async def one(intended: float, prompt: str) -> None:
        request = _request(port, model, prompt, streaming)
        try:
            if streaming:
                timeline: Timeline | None = await asyncio.wait_for(
                    stream("127.0.0.1", port, request), timeout=5
                )
            else:
                timeline = await asyncio.wait_for(_whole(port, request), timeout=5)
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
    limit = args.max_batch / (args.call_ms / 1000)
    server = EmbeddedRedis().start()
    client = redis.Redis.from_url(server.url)
    queue = new_queue("streaming")
    env = simulated_env(server.url, queue, call_ms=args.call_ms, max_batch=args.max_batch,
                        SIMULATED_EXTRA_WORDS=str(EXTRA_WORDS))  # fmt: skip
    stack = simulated_stack(env, [None])
    try:
        stack.start(timeout_s=120)
        assert stack.port is not None
        expected: Callable[[str], str] = lambda p: expected_completion(p, EXTRA_WORDS)  # noqa: E731
        asyncio.run(_load(stack.port, queue, limit * 0.3, 2, True, "warm"))
        rows = []
        for share in LOADS:
            rate = limit * share
            commands, published = {}, {}
            for streaming in (True, False):
                before, publishes = redis_commands(client), _publishes(client)
                tag = f"{'s' if streaming else 'w'}{share}"
                found = asyncio.run(_load(stack.port, queue, rate, args.seconds, streaming, tag))
                commands[streaming] = (redis_commands(client) - before) / len(found)
                published[streaming] = (_publishes(client) - publishes) / len(found)
                if streaming:
                    streams = found
            good = [t for _, p, t in streams if t and t.done and t.text == expected(p)]
            ttft = [t.arrivals[0] - start for start, _, t in streams
                    if t and t.done and t.arrivals]  # fmt: skip
            itl = [b - a for t in good for a, b in zip(t.arrivals, t.arrivals[1:], strict=False)]
            # The whole answers' run publishes each batch's answers alone.
            deltas = max(0.0, published[True] - published[False])
            added = commands[True] - commands[False]
            rows.append([
                f"{share:.0%} ({rate:g}/s)", f"{len(good) / args.seconds:.1f}",
                _ms(ttft, 50), _ms(ttft, 99), _ms(itl, 50), _ms(itl, 99),
                f"{commands[True]:.1f}", f"{commands[False]:.1f}", f"{deltas:.1f}",
                f"{added / deltas:.2f}" if deltas else "-",
            ])  # fmt: skip
            print(f"  {rows[-1]}", flush=True)
    finally:
        stack.stop()
        server.stop()
    print(f"\nStreams of 16 words, one simulated GPU: {args.call_ms} ms calls of up to "
          f"{args.max_batch} (limit {limit:g}/s), {args.seconds:g} s per load\n")  # fmt: skip
    header = ["load", "goodput/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
              "Redis cmds/stream", "cmds/whole answer", "delta msgs/stream",
              "added cmds/delta msg"]  # fmt: skip
    print(markdown_table(header, rows))
