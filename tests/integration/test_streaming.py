"""Tokens as they are sampled: the `openai` client's streams (sync and async, completions and
chat) against gunicorn, a simulated worker whose 100 ms calls stream 16 words each, and Redis;
the answers' deltas travel through Redis (batching.deltas) and arrive while the call runs."""

from __future__ import annotations

import asyncio
import functools
import http.client
import json
import math
import os
import subprocess
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
from openai import AsyncOpenAI, OpenAI
from prometheus_client.parser import text_string_to_metric_families

from batching.aggregator import BatchAggregator
from batching.deltas import is_delta, parse_deltas
from batching.generation import render_chat_plain
from batching.policy import Policy
from devstack.stack import Stack
from operations import dashboard
from telemetry import stats
from tests.support.http import request
from tests.support.ingress_nginx import IngressNginx
from tests.support.nginx_proxy import Nginx, nginx_binary
from tests.support.queue_views import batch_log_of
from tests.support.waiting import wait_until
from workers.samplers.simulated import expected_completion
from workers.turns import QUEUE_TIMES_EVERY_S

pytestmark = pytest.mark.integration

EXTRA_WORDS = 10  # 16 words a completion
CALL_MS = 100
# A 100 ms call with deltas every 10 ms at most shows at least this many content chunks.
MIN_CHUNKS = 8
STREAMS_TIMED = 10


def _streaming_env() -> dict[str, str]:
    return {
        "SAMPLER": "simulated",
        "SIMULATED_BATCH_MS": str(CALL_MS),
        "SIMULATED_EXTRA_WORDS": str(EXTRA_WORDS),
        "SAMPLING_DEADLINE_MS": "5000",  # what arrives, not the deadline, is tested here
    }


@pytest.fixture(scope="module")
def streaming(start_stack: Callable[..., Stack]) -> Stack:
    return start_stack("streaming", env=_streaming_env())


@pytest.fixture(scope="module")
def client(streaming: Stack) -> OpenAI:
    return OpenAI(base_url=f"{streaming.base_url}/v1", api_key="not-checked", max_retries=0)


@pytest.fixture(scope="module")
def model(streaming: Stack) -> str:
    return streaming.env["SAMPLING_QUEUE"]


def expected(prompt: str) -> str:
    return expected_completion(prompt, EXTRA_WORDS)


def _stream_arrivals(client: OpenAI, model: str) -> list[float]:
    """One stream of a new prompt, its content checked; when each content chunk arrived."""
    prompt = f"stream me {uuid.uuid4().hex[:6]}"
    arrivals: list[float] = []
    texts: list[str] = []
    finishes = []
    stream = client.completions.create(
        model=model, prompt=prompt, stream=True, stream_options={"include_usage": True},
        max_tokens=32,
    )  # fmt: skip
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.text:
                arrivals.append(time.monotonic())
                texts.append(choice.text)
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert "".join(texts) == expected(prompt)
    assert len(texts) >= MIN_CHUNKS, texts
    assert finishes == ["stop"]
    assert usage is not None
    assert usage.completion_tokens == len(expected(prompt).split())
    return arrivals


def test_a_completion_streams_chunk_by_chunk_while_its_call_runs(
    client: OpenAI, model: str
) -> None:
    # Spread over the call, not in one piece at its end. A busy machine can hold a stream's
    # bytes back and hand them over at once; a service that sends at the end does so every
    # time, so one spread stream of a few shows the chunks leave while the call runs.
    spreads = []
    for _ in range(3):
        arrivals = _stream_arrivals(client, model)
        spreads.append(arrivals[-1] - arrivals[0])
        if spreads[-1] >= 0.5 * CALL_MS / 1000:
            break
    assert max(spreads) >= 0.5 * CALL_MS / 1000, spreads


def test_a_chat_streams_with_its_role_first(client: OpenAI, model: str) -> None:
    content = f"chat stream {uuid.uuid4().hex[:6]}"
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], stream=True, max_tokens=32
    )
    chunks = [chunk for chunk in stream if chunk.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [chunk.choices[0].delta.content for chunk in chunks if chunk.choices[0].delta.content]
    assert "".join(deltas) == expected(render_chat_plain((("user", content),)))
    assert len(deltas) >= MIN_CHUNKS
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_streams_of_one_batch_each_get_their_own_text(streaming: Stack, model: str) -> None:
    async def run() -> list[tuple[str, int]]:
        async with AsyncOpenAI(
            base_url=f"{streaming.base_url}/v1", api_key="not-checked", max_retries=0
        ) as client:

            async def one(prompt: str) -> tuple[str, int]:
                stream = await client.completions.create(
                    model=model, prompt=prompt, stream=True, max_tokens=32
                )
                texts = [c.choices[0].text async for c in stream if c.choices and c.choices[0].text]
                return "".join(texts), len(texts)

            return await asyncio.gather(*(one(f"together {i}") for i in range(20)))

    found = asyncio.run(run())
    assert [text for text, _ in found] == [expected(f"together {i}") for i in range(20)]
    assert all(chunks >= MIN_CHUNKS for _, chunks in found), found


def test_choices_of_one_request_stream_side_by_side(client: OpenAI, model: str) -> None:
    prompts = [f"left {uuid.uuid4().hex[:6]}", f"right {uuid.uuid4().hex[:6]}"]
    stream = client.completions.create(model=model, prompt=prompts, n=2, stream=True, max_tokens=32)
    texts: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {index: expected(prompts[index // 2]) for index in range(4)}


def test_non_streaming_answers_are_unchanged(streaming: Stack, model: str) -> None:
    prompt = f"whole {uuid.uuid4().hex[:6]}"
    reply = request(
        streaming.base_url,
        "/v1/completions",
        json.dumps({"model": model, "prompt": prompt, "max_tokens": 32}),
        headers={"Content-Type": "application/json"},
    )
    assert reply.status == 200
    assert reply.headers["content-length"] == str(len(reply.body.encode()))
    assert json.loads(reply.body)["choices"][0]["text"] == expected(prompt)


def batch_records(stack: Stack) -> list[dict[str, Any]]:
    aggregator = BatchAggregator(
        redis.Redis.from_url(stack.env["REDIS_URL"]), stack.env["SAMPLING_QUEUE"]
    )
    return [json.loads(raw) for raw in batch_log_of(aggregator).recent()]


def _newer(
    newest: Callable[[], dict[str, Any] | None], before: dict[str, Any] | None
) -> dict[str, Any] | None:
    found = newest()
    return found if found != before else None


def test_the_first_chunk_comes_soon_after_its_calls_start(
    streaming: Stack, client: OpenAI, model: str
) -> None:
    """Time to first token, from the call's start (its batch record, by the Redis node's
    clock, which is this machine's) to the first content chunk's arrival."""

    def first_chunk_at(index: int) -> float:
        stream = client.completions.create(
            model=model, prompt=f"first {index} {uuid.uuid4().hex[:6]}", stream=True
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                arrived = time.time()
                stream.close()
                return arrived
        raise AssertionError("no content")

    def newest() -> dict[str, Any] | None:
        records = batch_records(streaming)
        return records[0] if records else None

    waits = []
    for index in range(30):  # one at a time: the newest record is its call's
        before = newest()
        arrived = first_chunk_at(index)
        record = wait_until(functools.partial(_newer, newest, before))
        assert record is not None  # wait_until returns a truthy value
        waits.append(arrived - record["call_started_ms"] / 1000)
    waits.sort()
    assert waits[int(0.9 * len(waits)) - 1] <= 0.025, " ".join(f"{w * 1000:.0f}" for w in waits)


def _leave_after_the_first_chunk(stack: Stack, model: str, content: str) -> None:
    """A chat stream whose client reads its first event (the role: its items have joined
    their batch) and closes the connection."""
    connection = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=10)
    body = {"model": model, "messages": [{"role": "user", "content": content}], "stream": True}
    connection.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline()  # the first chunk's size line (chunked transfer)
    connection.close()


def _slow_stack(start_stack: Callable[..., Stack], label: str) -> Stack:
    """A stack whose calls take 1 s: time for clients to come and go around one."""
    env = {"SAMPLER": "simulated", "SIMULATED_BATCH_MS": "1000",
           "SIMULATED_EXTRA_WORDS": str(EXTRA_WORDS), "SAMPLING_DEADLINE_MS": "8000"}  # fmt: skip
    return start_stack(label, env=env)


def test_clients_that_leave_before_the_seal_take_no_place_in_a_call(
    start_stack: Callable[..., Stack],
) -> None:
    """A call runs 1 s; meanwhile 50 streams join the next batch and leave: when it is sealed,
    none of their items reaches the sampler, and each counts as cancelled."""
    stack = _slow_stack(start_stack, "cancel")
    model = stack.env["SAMPLING_QUEUE"]
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="not-checked", max_retries=0)
    running = client.completions.create(model=model, prompt="the running call", stream=True)
    next(chunk for chunk in running if chunk.choices and chunk.choices[0].text)  # it runs
    with ThreadPoolExecutor(10) as pool:
        list(pool.map(lambda i: _leave_after_the_first_chunk(stack, model, f"gone {i}"), range(50)))
    "".join(chunk.choices[0].text for chunk in running if chunk.choices)  # to its end

    def sealed_after() -> list[dict[str, Any]]:  # every batch the 50 joined, once sealed
        found = [record for record in batch_records(stack) if record.get("cancelled")]
        return found if sum(record["cancelled"] for record in found) >= 50 else []

    cancelled = wait_until(sealed_after, timeout_s=20)
    assert sum(record["cancelled"] for record in cancelled) == 50
    assert all(record["sampled"] == 0 for record in cancelled)
    assert all(record["call_started_ms"] is None for record in cancelled)  # no call at all
    counted = 'sampling_requests_total{outcome="cancelled"} 50.0'
    wait_until(lambda: counted in request(stack.base_url, "/metrics", method="GET").body)


def test_a_client_that_leaves_during_the_call_stops_its_deltas(
    start_stack: Callable[..., Stack],
) -> None:
    stack = _slow_stack(start_stack, "cancel-running")
    model = stack.env["SAMPLING_QUEUE"]
    listener = redis.Redis.from_url(stack.env["REDIS_URL"]).pubsub()
    listener.psubscribe(f"sampling:{{{model}*:results")  # its shards' channels alone
    prompt = f"leave midway {uuid.uuid4().hex[:6]}"
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="not-checked", max_retries=0)
    stream = client.completions.create(model=model, prompt=prompt, stream=True)
    texts = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            texts.append(chunk.choices[0].text)
        if len(texts) == 2:
            stream.close()
            break
    published = ""
    answered = False
    give_up = time.monotonic() + 10
    while not answered and time.monotonic() < give_up:
        message = listener.get_message(timeout=0.5)
        if message is None or message["type"] != "pmessage":
            continue
        _, _, payload = message["data"].partition(b" ")
        if is_delta(payload):
            published += parse_deltas(payload).get(0, (0, ""))[1]
        else:
            answered = True  # the batch's answers: the call has ended
    assert answered
    full = expected(prompt)
    assert full.startswith(published)
    assert len(published.split()) < len(full.split()) / 2, published


def _streamed_completion(client: OpenAI, model: str, prompt: str) -> tuple[list[str], float]:
    """A streamed completion's content chunks, and the time from the first to the last."""
    arrivals, texts = [], []
    for chunk in client.completions.create(model=model, prompt=prompt, stream=True, max_tokens=32):
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.monotonic())
            texts.append(chunk.choices[0].text)
    return texts, arrivals[-1] - arrivals[0]


@pytest.mark.parametrize("proxy_kind", [Nginx, IngressNginx], ids=["nginx", "k8s-ingress"])
def test_streams_pass_through_the_shipped_proxies_as_they_come(
    streaming: Stack, model: str, proxy_kind: type[Nginx]
) -> None:
    """deploy/nginx, and the Kubernetes Ingress as ingress-nginx configures nginx for it
    (tests/support/ingress_nginx.py): both buffer whole answers, and pass a stream's events
    on as they come."""
    if nginx_binary() is None:
        if os.environ.get("REQUIRE_NGINX"):
            pytest.fail("REQUIRE_NGINX is set but nginx is not installed")
        pytest.skip("nginx not installed (apt-get install nginx): the proxy is not tested")
    with proxy_kind(streaming.port) as proxy:
        client = OpenAI(base_url=f"{proxy.base_url}/v1", api_key="not-checked", max_retries=0)
        prompt = f"through nginx {uuid.uuid4().hex[:6]}"
        texts, spread_s = _streamed_completion(client, model, prompt)
        assert "".join(texts) == expected(prompt)
        assert len(texts) >= MIN_CHUNKS
        assert spread_s >= 0.5 * CALL_MS / 1000  # not held by nginx until the end
        whole = request(proxy.base_url, "/sample", "buffered as before")
        assert whole.status == 200
        assert whole.headers["content-length"] == str(len(whole.body.encode()))


def test_curl_streams_sample_as_plain_text(streaming: Stack) -> None:
    """`curl -N` on /sample?stream=1: the text arrives piece by piece, nothing else."""
    prompt = f"curl stream {uuid.uuid4().hex[:6]}"
    curl = subprocess.Popen(
        ["curl", "-sS", "-N", "--data-binary", prompt, f"{streaming.base_url}/sample?stream=1"],
        stdout=subprocess.PIPE,
    )
    assert curl.stdout is not None
    pieces: list[tuple[float, bytes]] = []
    while data := os.read(curl.stdout.fileno(), 65536):
        pieces.append((time.monotonic(), data))
    assert curl.wait(timeout=10) == 0
    assert b"".join(data for _, data in pieces).decode() == expected(prompt)
    assert len(pieces) >= MIN_CHUNKS // 2  # a pipe may join two pieces that came together
    assert pieces[-1][0] - pieces[0][0] >= 0.5 * CALL_MS / 1000


def _histogram(stack: Stack, name: str) -> tuple[float, float]:
    """A histogram's count and sum on the stack's /metrics, over every series (workers)."""
    reply = request(stack.base_url, "/metrics", method="GET")
    count = total = 0.0
    for family in text_string_to_metric_families(reply.body):
        for sample in family.samples:
            if sample.name == f"{name}_count":
                count += sample.value
            elif sample.name == f"{name}_sum":
                total += sample.value
    return count, total


def _histogram_of(stack: Stack, name: str, count: int) -> float:
    """The histogram's sum once it counts `count`."""

    def counted() -> tuple[float, float] | None:
        found = _histogram(stack, name)
        return found if found[0] == count else None

    found = wait_until(counted, what=f"{name} counts {count}")
    assert found is not None  # wait_until returns a truthy value
    return found[1]


def _counted(summary: stats.Summary, histogram: str) -> int:
    return sum(value for name, value in summary.counts.items() if name.startswith(histogram))


def test_time_to_first_token_and_queue_time_are_measured(
    start_stack: Callable[..., Stack],
) -> None:
    """Streams one at a time on a stack of their own: /metrics counts each stream's time to
    first token and its item's queue time (arrival to its call's start, from the batch
    records), and the stats page's medians fall in the buckets of the same figures."""
    stack = start_stack("stream-times", env=_streaming_env())
    model = stack.env["SAMPLING_QUEUE"]
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="not-checked", max_retries=0)
    measured: dict[str, list[float]] = {stats.TTFT: [], stats.QUEUE_TIME: []}
    served: dict[str, list[float]] = {stats.TTFT: [], stats.QUEUE_TIME: []}
    sums = {stats.TTFT: 0.0, stats.QUEUE_TIME: 0.0}
    for index in range(STREAMS_TIMED):
        sent = time.time()
        stream = client.completions.create(model=model, prompt=f"timed {index}", stream=True)
        arrivals = [time.time() for c in stream if c.choices and c.choices[0].text]
        measured[stats.TTFT].append(arrivals[0] - sent)
        records = wait_until(functools.partial(_records_at_least, stack, index + 1))
        # The newest batch's call start, by the Redis node's clock (this machine's).
        measured[stats.QUEUE_TIME].append(records[0]["call_started_ms"] / 1000 - sent)
        # One stream at a time: each histogram's sum grows by exactly this stream's figure.
        for histogram, name in _METRIC_OF.items():
            total = _histogram_of(stack, name, index + 1)
            served[histogram].append(total - sums[histogram])
            sums[histogram] = total

    # The server's clocks start after the client's (HTTP, Django: more on a busy machine), and
    # a stream's first chunk comes after its call started (the queue time's end; 1 ms: the
    # batch records' whole milliseconds).
    for histogram, slack_s in ((stats.TTFT, 0.0), (stats.QUEUE_TIME, 0.001)):
        pairs = list(zip(served[histogram], measured[histogram], strict=True))
        assert all(0 < server <= client + slack_s for server, client in pairs), (histogram, pairs)
    first_and_queued = list(zip(served[stats.TTFT], served[stats.QUEUE_TIME], strict=True))
    assert all(ttft >= queued - 0.001 for ttft, queued in first_and_queued), first_and_queued

    def recent() -> stats.Summary | None:
        board = dashboard.build(redis.Redis.from_url(stack.env["REDIS_URL"]), model, Policy())
        counted = (_counted(board.recent, name) for name in (stats.TTFT, stats.QUEUE_TIME))
        return board.recent if all(c == STREAMS_TIMED for c in counted) else None

    # The workers' queue times come with a heartbeat every 10 s.
    summary = wait_until(recent, timeout_s=3 * QUEUE_TIMES_EVERY_S)
    assert summary is not None
    assert _counted(summary, stats.ITL) >= STREAMS_TIMED * (MIN_CHUNKS - 1)
    for histogram, figures in served.items():
        # The page reads a median from 10%-wide buckets: it lies in the bucket of the figure
        # of the median's rank, interpolated, so that bucket's bounds are all it promises.
        low, high = _bucket_bounds_ms(sorted(figures)[math.ceil(len(figures) / 2) - 1] * 1000)
        found = summary.latency_percentile_ms(50, histogram)
        assert found is not None, histogram
        assert low <= found <= high, (histogram, found, figures)


# The stats page's histograms and the same figures on /metrics.
_METRIC_OF = {
    stats.TTFT: "sampling_time_to_first_token_seconds",
    stats.QUEUE_TIME: "sampling_request_queue_time_seconds",
}


def _bucket_bounds_ms(figure_ms: float) -> tuple[float, float]:
    """The bounds of the stats page's latency bucket of `figure_ms`, and of its neighbour
    where /metrics' sums (floats summed, then subtracted) put it within 1 us of an edge."""
    bounds = (0.0, *stats.LATENCY_BOUNDS_MS)
    lowest = stats.latency_bucket(max(0.0, figure_ms - 0.001))
    highest = stats.latency_bucket(figure_ms + 0.001)
    return bounds[lowest], bounds[min(highest + 1, len(bounds) - 1)]


def _records_at_least(stack: Stack, count: int) -> list[dict[str, Any]]:
    records = batch_records(stack)
    return records if len(records) >= count else []
