"""The response cache against real processes: an identical greedy or seeded request is
answered from Redis with exactly the first one's completion, no batch sampled for it, and
`x-cache` says so; hits and misses are counted in /metrics and the statistics."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from batching import policy
from batching.aggregator import BatchAggregator
from batching.keys import QueueKeys
from batching.registry import HEARTBEAT_TIMEOUT_MS, WorkerRegistry
from devstack.stack import Stack
from telemetry import stats
from tests.support import ADMIN_PASSWORD, ADMIN_USER
from tests.support.admin_client import AdminSession
from tests.support.http import request, sample
from tests.support.keys import PROBES, bearer, create_key
from tests.support.queue_views import batch_log_of
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cached(start_stack: Callable[..., Stack]) -> Stack:
    return start_stack(
        "cached", env={"SAMPLER": "simulated", "SAMPLING_RESPONSE_CACHE": "1"}, web_processes=2
    )


def lookups(stack: Stack) -> dict[str, float]:
    reply = request(stack.base_url, "/metrics", method="GET")
    return {
        sample.labels["result"]: sample.value
        for family in text_string_to_metric_families(reply.body)
        for sample in family.samples
        if sample.name == "sampling_cache_lookups_total"
    }


def sampled_items(stack: Stack) -> int:
    """Items the worker has sampled: the sizes in its batch log."""
    aggregator = BatchAggregator(
        redis.Redis.from_url(stack.env["REDIS_URL"]), stack.env["SAMPLING_QUEUE"]
    )
    return sum(json.loads(raw)["size"] for raw in batch_log_of(aggregator).recent())


def counted_in_stats(stack: Stack) -> tuple[int, int]:
    client = redis.Redis.from_url(stack.env["REDIS_URL"])
    now = int(time.time())
    buckets = stats.read_buckets(client, stack.env["SAMPLING_QUEUE"], stats.SECOND, now - 600,
                                 now + 1)  # fmt: skip
    counts = stats.merge(counts for _, counts in buckets)
    return counts[stats.CACHE_HITS], counts[stats.CACHE_MISSES]


def test_an_identical_request_is_answered_from_the_cache_exactly(cached: Stack) -> None:
    before, stats_before = lookups(cached), counted_in_stats(cached)
    items = sampled_items(cached)
    prompt = f"E equals {uuid.uuid4().hex[:8]} "
    first = sample(cached.base_url, prompt)
    assert (first.status, first.headers["x-cache"]) == (200, "miss")
    # The worker stores the entry with the batch's record, just after the answer: on a busy
    # machine a request can come in between, a miss sampled again. The first hit shows it in.
    until_stored = []

    def stored() -> bool:
        until_stored.append(sample(cached.base_url, prompt))
        return until_stored[-1].headers["x-cache"] == "hit"

    wait_until(stored, 5, "the entry stored")
    assert {(reply.status, reply.body) for reply in until_stored} == {(200, first.body)}
    again = [sample(cached.base_url, prompt) for _ in range(4)]  # both web processes, likely
    assert {(reply.status, reply.headers["x-cache"], reply.body) for reply in again} == {
        (200, "hit", first.body)
    }
    # No GPU for the hits: once a later miss is logged (a worker logs a batch after it
    # answered it), the misses' items and that one were sampled, no more.
    sampled = items + len(until_stored) + 1
    assert sample(cached.base_url, prompt + "later").headers["x-cache"] == "miss"
    wait_until(lambda: sampled_items(cached) >= sampled, 5)
    assert sampled_items(cached) == sampled

    client = OpenAI(base_url=f"{cached.base_url}/v1", api_key="EMPTY", max_retries=0)
    model = cached.env["SAMPLING_QUEUE"]
    settings = {"model": model, "prompt": prompt, "temperature": 0.9, "seed": 7, "max_tokens": 3}
    raw = client.completions.with_raw_response.create(**settings)  # type: ignore[call-overload]
    assert raw.headers["x-cache"] == "miss"
    sampled = raw.parse()
    raws = []  # the entry lands just after the answer: a request may come in between

    def stored_seeded() -> bool:
        raws.append(client.completions.with_raw_response.create(**settings))  # type: ignore[call-overload]
        return bool(raws[-1].headers["x-cache"] == "hit")

    wait_until(stored_seeded, 5, "the seeded entry stored")
    # A seeded request sampled again before its entry landed gets the same text.
    assert {raw.parse().choices[0].text for raw in raws} == {sampled.choices[0].text}
    hit = raws[-1].parse()
    assert [c.text for c in hit.choices] == [c.text for c in sampled.choices]
    assert [c.finish_reason for c in hit.choices] == [c.finish_reason for c in sampled.choices]
    # The same tokens, the hit's prompt reported as cached (OpenAI's cached_tokens).
    assert hit.usage is not None
    assert sampled.usage is not None
    assert hit.usage.model_dump(exclude={"prompt_tokens_details"}) == sampled.usage.model_dump(
        exclude={"prompt_tokens_details"}
    )
    assert hit.usage.prompt_tokens_details is not None
    assert hit.usage.prompt_tokens_details.cached_tokens == hit.usage.prompt_tokens
    assert sampled.usage.prompt_tokens_details is not None
    assert sampled.usage.prompt_tokens_details.cached_tokens == 0
    # A setting changed is another request; a sampled request without a seed is not cached.
    other = client.completions.with_raw_response.create(**{**settings, "seed": 8})  # type: ignore[call-overload]
    assert other.headers["x-cache"] == "miss"
    unseeded = {**settings, "seed": None}
    for _ in range(2):
        reply = client.completions.with_raw_response.create(**unseeded)  # type: ignore[call-overload]
        assert "x-cache" not in reply.headers

    hits, misses = 1 + 4 + 1, 1 + (len(until_stored) - 1) + 1 + 1 + (len(raws) - 1) + 1
    after = lookups(cached)
    assert after.get("hit", 0) - before.get("hit", 0) == hits
    assert after.get("miss", 0) - before.get("miss", 0) == misses

    def in_stats() -> bool:  # web processes flush their statistics once a second
        now = counted_in_stats(cached)
        return (now[0] - stats_before[0], now[1] - stats_before[1]) == (hits, misses)

    wait_until(in_stats, 5, "the lookups counted in the statistics")


def completion(stack: Stack, prompt: str, key: str | None = None) -> tuple[str, str]:
    """A greedy /v1/completions of `prompt` (the policy's max tokens): (x-cache, its text), or
    (its status, its body) when it is not a 200."""
    body = json.dumps({"model": stack.env["SAMPLING_QUEUE"], "prompt": prompt})
    reply = request(stack.base_url, "/v1/completions", body, headers=bearer(key) if key else {})
    if reply.status != 200:
        return str(reply.status), reply.body
    return reply.headers["x-cache"], json.loads(reply.body)["choices"][0]["text"]


def until_hit(stack: Stack, prompt: str, key: str) -> None:
    """Ask `prompt` with `key` until a hit: an entry lands just after its answer, so a request
    that comes in between is a miss, sampled again; anything else fails."""
    seen: list[str] = []

    def hit() -> bool:
        seen.append(completion(stack, prompt, key)[0])
        return seen[-1] == "hit"

    wait_until(hit, 5, "the key's entry stored")
    assert set(seen[:-1]) <= {"miss"}, seen


def known_key(stack: Stack) -> str:
    """A new API key, once every web process knows it (with keys optional, an unknown key is
    served as anonymous): a key with a request limit gets its x-ratelimit-* headers, on a 400
    too."""
    key = create_key(stack, f"tenant {uuid.uuid4().hex[:6]}", "--rpm", "100000")

    def known_everywhere() -> bool:
        return all(
            "x-ratelimit-limit-requests"
            in request(stack.base_url, "/v1/completions", "{}", headers=bearer(key)).headers
            for _ in range(PROBES)
        )

    wait_until(known_everywhere, 5, "the key known to every web process")
    return key


def test_another_keys_identical_request_is_a_miss_unless_the_policy_shares(
    cached: Stack, admin: AdminSession
) -> None:
    key_a, key_b = (known_key(cached) for _ in range(2))
    prompt = f"E equals {uuid.uuid4().hex[:8]} "
    assert completion(cached, prompt, key_a)[0] == "miss"
    until_hit(cached, prompt, key_a)
    # Key B learns nothing of what key A asked: its own entry, sampled for it.
    assert completion(cached, prompt, key_b)[0] == "miss"
    until_hit(cached, prompt, key_b)
    assert completion(cached, prompt)[0] == "miss"  # anonymous requests are a scope of their own
    # Shared by the policy: one key's request is answered from another's.
    version = save_policy(cached, admin, response_cache_shared="on")
    try:
        wait_until(lambda: workers_report(cached, version), 10, "the workers' new policy")

        def answered_from_key_as_entry() -> bool:
            # Each web process reloads the policy on its own: until both have, key B's request
            # may look under the old version. A fresh prompt a try keeps key B's scope empty.
            shared = f"E equals {uuid.uuid4().hex[:8]} "
            until_hit(cached, shared, key_a)
            return completion(cached, shared, key_b)[0] == "hit"

        wait_until(answered_from_key_as_entry, 10, "key B answered from key A's entry")
    finally:
        delete_policy(cached, admin)


@pytest.fixture(scope="module")
def admin(cached: Stack) -> AdminSession:
    session = AdminSession(cached.base_url)
    session.login(ADMIN_USER, ADMIN_PASSWORD)
    return session


POLICIES = "/admin/sampling/samplingpolicy/"


def save_policy(stack: Stack, admin: AdminSession, **changes: str) -> int:
    """Save the queue's policy in the admin, as an operator does (the row added, then
    changed); the version it published."""
    queue = stack.env["SAMPLING_QUEUE"]
    row = re.search(rf'samplingpolicy/(\d+)/change/">{re.escape(queue)}<', admin.get(POLICIES)[1])
    fields = {
        "queue": queue, "max_batch_size": "100", "deadline_ms": "500",
        "max_prompt_bytes": "8192", "max_new_tokens": "32", "temperature": "0", "top_p": "1",
        "stop": "", "fill_target_percent": "90", "response_cache": "on",
        "response_cache_ttl_s": "300", **changes,
    }  # fmt: skip
    fields = {name: value for name, value in fields.items() if value != "off"}
    path = f"{POLICIES}{row.group(1)}/change/" if row else f"{POLICIES}add/"
    status, url, page = admin.post_form(path, fields)
    assert (status, url) == (200, stack.base_url + POLICIES), page
    raw = redis.Redis.from_url(stack.env["REDIS_URL"]).get(QueueKeys(queue).policy)
    assert raw is not None
    return policy.Policy.from_json(raw).version


def delete_policy(stack: Stack, admin: AdminSession) -> None:
    """Back to the environment's policy for the other tests of this module."""
    queue = stack.env["SAMPLING_QUEUE"]
    row = re.search(rf'samplingpolicy/(\d+)/change/">{re.escape(queue)}<', admin.get(POLICIES)[1])
    if row:
        status, url, _ = admin.post_form(f"{POLICIES}{row.group(1)}/delete/", {"post": "yes"})
        assert (status, url) == (200, stack.base_url + POLICIES)


def workers_report(stack: Stack, version: int) -> bool:
    """Every live worker of the stack reports `version` in its heartbeat."""
    registry = WorkerRegistry(
        redis.Redis.from_url(stack.env["REDIS_URL"]), QueueKeys(stack.env["SAMPLING_QUEUE"])
    )
    since = time.time() - HEARTBEAT_TIMEOUT_MS / 1000
    infos = [info for _, info in registry.infos(since) if info.get("heartbeat_at", 0) >= since]
    return bool(infos) and all(info.get("policy_version") == version for info in infos)


Served = list[tuple[float, str, str, str]]  # (sent at, prompt, x-cache, text)


def hits_after_a_change(
    stack: Stack, admin: AdminSession, prompt: str, served: Served, words: int
) -> list[str]:
    """Once traffic of `prompt` hits entries of the current policy, publish one of `words`
    max tokens; the texts of the hits of requests sent after every live worker reported it."""
    wait_until(lambda: any(p == prompt and c == "hit" for _, p, c, _ in served[-8:]), 5)
    version = save_policy(stack, admin, max_new_tokens=str(words))
    wait_until(lambda: workers_report(stack, version), 10, "the new policy")
    reported = time.monotonic()
    wait_until(lambda: sum(s > reported for s, *_ in served) >= 40, 10)
    return [
        text
        for sent, p, cache_result, text in list(served)
        if sent > reported and p == prompt and cache_result == "hit"
    ]


def test_no_answer_of_the_old_policy_is_served_once_every_worker_reports_the_new(
    cached: Stack, admin: AdminSession
) -> None:
    """Under traffic of identical requests, the policy's max tokens changes (2 words, then 3,
    ...): once every live worker's heartbeat reports the new version, no hit carries an answer
    sampled under the old one (a worker used to store what it sampled under the digest of the
    web process's newer policy, and web processes served entries of their older one)."""
    current = {"prompt": f"E equals {uuid.uuid4().hex[:8]} ", "stop": False}
    served: Served = []

    def traffic() -> None:
        while not current["stop"]:
            prompt, sent = str(current["prompt"]), time.monotonic()
            served.append((sent, prompt, *completion(cached, prompt)))

    with ThreadPoolExecutor(4) as pool:
        try:
            for _ in range(4):
                pool.submit(traffic)
            for turn in range(6):
                words = 2 + turn % 2
                prompt = current["prompt"] = f"E equals {uuid.uuid4().hex[:8]} "
                hits = hits_after_a_change(cached, admin, prompt, served, words)
                assert hits, "no hit after the workers reported the new policy"
                assert {len(text.split()) for text in hits} == {words}, (turn, hits)
        finally:
            current["stop"] = True
            delete_policy(cached, admin)
    # Both kinds of answer, and on a busy machine admission's refusals (a 503, or a 504 past
    # the deadline), which say so: never an answer of another kind.
    results = {cache_result for _, _, cache_result, _ in served}
    assert {"hit", "miss"} <= results <= {"hit", "miss", "503", "504"}, results
