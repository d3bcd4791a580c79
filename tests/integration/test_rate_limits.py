"""Rate limits per API key against real processes: 429s exactly at the configured limit,
whatever the number of web processes, with Retry-After, OpenAI's error and the x-ratelimit-*
headers; a request's items join in one round trip and count once; a key with a tokens limit
reserves each request's most at admission, so a burst of concurrent requests is served its
limit and one request's reservation at most, and the tokens used refuse the key soon after."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import redis
from openai import OpenAI

from accounts import access, ratelimit
from batching.keys import ShardKeys
from devstack.stack import Stack
from tests.support import unique_queue
from tests.support.http import Reply, request, sample
from tests.support.keys import bearer, create_key, known_everywhere
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

WEB_PROCESSES = 4


@pytest.fixture(scope="module")
def embedder() -> str:
    return unique_queue("limited-embed")


@pytest.fixture(scope="module")
def limited(start_stack: Callable[..., Stack], embedder: str) -> Stack:
    queue = unique_queue("limited")
    return start_stack(
        "limited",
        env={"SAMPLER": "simulated", "SAMPLING_REQUIRE_API_KEY": "1", "SAMPLING_QUEUE": queue,
             "SAMPLING_MODELS": f"{queue}=simulated,{embedder}=simulated-embedder"},
        web_processes=WEB_PROCESSES,
    )  # fmt: skip


def fresh_window(needed_s: float = 15.0) -> None:
    """Start in a rate window with `needed_s` left, so that the test's requests share it."""
    left = ratelimit.reset_in_s(time.time())
    if left < needed_s:
        wait_until(lambda: ratelimit.reset_in_s(time.time()) >= needed_s, left + 1, "a new window")


def new_limited_key(stack: Stack, *options: str) -> str:
    key = create_key(stack, f"limited {uuid.uuid4().hex[:6]}", *options)
    wait_until(lambda: known_everywhere(stack, key), 5)
    return key


def test_429_exactly_at_the_request_limit_with_headers_and_retry_after(limited: Stack) -> None:
    rpm = 7
    key = new_limited_key(limited, "--rpm", str(rpm))
    fresh_window()
    replies: list[Reply] = [
        sample(limited.base_url, f"E equals {n} ", headers=bearer(key)) for n in range(rpm + 6)
    ]
    statuses = [reply.status for reply in replies]
    served = statuses.count(200)
    # Exactly the first `rpm` are served, whichever process each request reached.
    assert statuses == [200] * rpm + [429] * 6
    remaining = [int(r.headers["x-ratelimit-remaining-requests"]) for r in replies[:rpm]]
    assert remaining == [rpm - n for n in range(1, rpm + 1)]
    for reply in replies:
        assert reply.headers["x-ratelimit-limit-requests"] == str(rpm)
        assert reply.headers["x-ratelimit-reset-requests"].endswith("s")
    refused = [reply for reply in replies if reply.status == 429][-1]
    assert refused.body.count("\n") == 1
    assert "rate limit" in refused.body
    assert 1 <= int(refused.headers["retry-after"]) <= ratelimit.WINDOW_S
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    # Redis counted the requests served, and those only.
    client = redis.Redis.from_url(limited.env["REDIS_URL"])
    counter = _counter(limited, key)
    assert int(client.get(counter) or 0) == served
    assert 0 < client.pttl(counter) <= ratelimit.COUNTER_TTL_MS

    # The OpenAI client reads the same refusal as its RateLimitError, at once.
    client_ = OpenAI(base_url=f"{limited.base_url}/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.RateLimitError) as caught:
        client_.completions.create(model=limited.env["SAMPLING_QUEUE"], prompt="x")
    assert caught.value.code == "rate_limit_exceeded"
    assert caught.value.response.headers["retry-after"]
    body = json.dumps({"input": "x"})
    reply = request(limited.base_url, "/api/inference", body, headers=bearer(key))
    assert (reply.status, json.loads(reply.body)["error"]) == (429, "RATE_LIMITED")
    assert int(client.get(counter) or 0) == rpm


def test_exactly_rpm_served_in_a_window_behind_several_web_processes(limited: Stack) -> None:
    """Concurrent requests of one key spread over every web process: exactly `rpm` served in
    the window, every other one a 429 (a process that had not seen the limit used to serve
    one more)."""
    rpm = 20
    key = new_limited_key(limited, "--rpm", str(rpm))
    fresh_window(30)
    with ThreadPoolExecutor(8) as pool:
        statuses = list(
            pool.map(
                lambda n: sample(limited.base_url, f"E equals {n} ", headers=bearer(key)).status,
                range(6 * rpm),
            )
        )
    assert statuses.count(200) == rpm
    assert statuses.count(429) == len(statuses) - rpm
    client = redis.Redis.from_url(limited.env["REDIS_URL"])
    assert int(client.get(_counter(limited, key)) or 0) == rpm
    # Each process refuses the key now: the rest of the window is all 429s.
    assert {sample(limited.base_url, "x", headers=bearer(key)).status for _ in range(12)} == {429}


def test_a_request_of_many_items_joins_in_one_round_trip_and_counts_once(limited: Stack) -> None:
    """n=100 choices: one Redis call for the request's items (each used to be its own round
    trip), and one request against rpm (SAMPLING_RATE_LIMIT_PER_ITEM is off by default)."""
    rpm = 3
    key = new_limited_key(limited, "--rpm", str(rpm))
    fresh_window()
    client = redis.Redis.from_url(limited.env["REDIS_URL"])
    marker = uuid.uuid4().hex
    payload = {"model": limited.env["SAMPLING_QUEUE"], "prompt": marker, "n": 100, "max_tokens": 2}
    with client.monitor() as monitor:
        reply = request(limited.base_url, "/v1/completions", json.dumps(payload),
                        headers=bearer(key))  # fmt: skip
        # The command stream up to a command sent after the request's.
        client.set(f"test:{marker}:end", 1, px=1000)
        calls = []
        for command in monitor.listen():
            if f"test:{marker}:end" in command["command"]:
                break
            # A call the web process sent carries the prompt (not a script's inner commands).
            if marker in command["command"] and command.get("client_type") != "lua":
                calls.append(command["command"].split(" ")[0])
    assert reply.status == 200, reply.body
    assert len(json.loads(reply.body)["choices"]) == 100
    assert calls == ["EVALSHA"]
    assert int(client.get(_counter(limited, key)) or 0) == 1
    statuses = [sample(limited.base_url, "E equals ", headers=bearer(key)).status for _ in range(3)]
    assert statuses == [200, 200, 429]


def test_a_concurrent_burst_is_served_its_tokens_limit_and_one_reservation_at_most(
    limited: Stack,
) -> None:
    tpm, n, max_tokens, burst = 100, 20, 6, 10
    key = new_limited_key(limited, "--tpm", str(tpm))
    fresh_window()
    client = OpenAI(base_url=f"{limited.base_url}/v1", api_key=key, max_retries=0)
    model = limited.env["SAMPLING_QUEUE"]

    def ask(index: int) -> int:
        """The completion tokens served to one request of the burst (0: refused 429)."""
        try:
            completion = client.completions.create(
                model=model, prompt=f"burst {index}", n=n, max_tokens=max_tokens
            )
        except openai.RateLimitError:
            return 0
        assert completion.usage is not None
        return completion.usage.completion_tokens

    with ThreadPoolExecutor(burst) as pool:
        served = list(pool.map(ask, range(burst)))
    assert any(served)
    assert sum(served) <= tpm + n * max_tokens, served


def test_completion_tokens_used_refuse_the_key(limited: Stack) -> None:
    tpm = 12
    key = new_limited_key(limited, "--tpm", str(tpm))
    fresh_window()
    client = OpenAI(base_url=f"{limited.base_url}/v1", api_key=key, max_retries=0)
    model = limited.env["SAMPLING_QUEUE"]
    spent = 0

    def served() -> int:
        """A completion's tokens; 0 for a refusal that another process's view, read while
        an earlier request's reservation was in flight, still holds (for a key poll at most)."""
        try:
            completion = client.completions.create(model=model, prompt="E equals ", max_tokens=5)
        except openai.RateLimitError:
            return 0
        assert completion.usage is not None
        return completion.usage.completion_tokens

    while spent < tpm:  # each completion's tokens are charged once it is answered
        spent += wait_until(served, 2 * access.POLL_INTERVAL_S + 1, "a completion served")
    assert spent >= tpm

    def refused_through_a_poll() -> float | None:
        """When a run of refusals began that lasted a whole key poll, so that every process
        answered from the charges (a few requests in a row may all reach one process);
        None when a request was served meanwhile."""
        began = time.monotonic()
        while time.monotonic() - began < access.POLL_INTERVAL_S + 0.1:
            if sample(limited.base_url, "E equals ", headers=bearer(key)).status != 429:
                return None
        return began

    # Every process reads the charges with its key poll (every 0.5 s).
    charged = time.monotonic()
    refused_from = wait_until(refused_through_a_poll, 5, "the key refused by every process")
    assert refused_from is not None  # wait_until returns a truthy value
    assert refused_from - charged < 2
    reply = sample(limited.base_url, "E equals ", headers=bearer(key))
    assert reply.status == 429
    assert reply.headers["x-ratelimit-limit-tokens"] == str(tpm)
    assert reply.headers["x-ratelimit-remaining-tokens"] == "0"
    assert "completion tokens" in reply.body
    # The window's hash holds the tokens the requests used, their reservations settled.
    charged = redis.Redis.from_url(limited.env["REDIS_URL"]).hget(
        access.KEYS.tokens(ratelimit.window_of(time.time())), str(_key_id(limited, key))
    )
    assert int(charged or 0) >= spent


def test_an_embedding_s_input_tokens_count_against_its_key_s_tpm(
    limited: Stack, embedder: str
) -> None:
    """An embedding reserves its input's bytes (its tokens' bound) and settles to its input
    tokens: a key whose embeddings used its tokens per minute is refused until the window
    ends, as it is for completion tokens."""
    tpm = 20
    key = new_limited_key(limited, "--tpm", str(tpm))
    fresh_window()
    client = OpenAI(base_url=f"{limited.base_url}/v1", api_key=key, max_retries=0)
    first = client.embeddings.create(model=embedder, input=" ".join(f"w{i}" for i in range(tpm)))
    assert first.usage.prompt_tokens >= tpm

    def refused() -> bool:
        try:
            client.embeddings.create(model=embedder, input="one more")
        except openai.RateLimitError as refusal:
            return refusal.code == "rate_limit_exceeded"
        return False

    wait_until(refused, 2 * access.POLL_INTERVAL_S + 1, "the key refused for its tokens")


def test_a_key_without_limits_gets_no_rate_headers(limited: Stack) -> None:
    key = new_limited_key(limited)
    reply = sample(limited.base_url, "E equals ", headers=bearer(key))
    assert reply.status == 200
    assert not [name for name in reply.headers if name.startswith("x-ratelimit")]


def _counter(stack: Stack, key: str) -> str:
    """The key's request counter of the current window."""
    window = ratelimit.window_of(time.time())
    return ShardKeys(stack.env["SAMPLING_QUEUE"]).requests_counter(_key_id(stack, key), window)


def _key_id(stack: Stack, key: str) -> int:
    """The key's id, as published (the record of its digest)."""
    raw = redis.Redis.from_url(stack.env["REDIS_URL"]).hget(
        access.KEYS.records, access.digest_of(key)
    )
    assert raw is not None
    return access.KeyRecord.from_json(raw).caller.key_id
