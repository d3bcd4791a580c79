"""End to end through real processes: gunicorn, a Celery worker and Redis."""

from __future__ import annotations

import json
import signal
import statistics
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
from celery import Celery

from batching.aggregator import DISPATCH_GRACE_MS, BatchAggregator
from batching.keys import ShardKeys
from batching.outcomes import ItemOutcome
from batching.policy import Policy
from bench.harness.stalled import StalledWorker
from devstack.embedded_redis import free_port
from devstack.stack import Stack
from tests.support.bursts import burst_until_answered
from tests.support.http import request, sample
from tests.support.probe_sampler import seen_key
from tests.support.queue_views import batch_log_of
from tests.support.waiting import wait_until
from workers.samplers.simulated import expected_completion

UNKNOWN_READINESS_NAMES = 1000

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def service(start_stack: Callable[..., Stack]) -> Stack:
    """The simulated sampler behind two gunicorn processes, as `make run` starts it."""
    return start_stack("sim", env={"SAMPLER": "simulated"}, web_processes=2)


@pytest.fixture(scope="module")
def probe(start_stack: Callable[..., Stack]) -> Stack:
    """A worker with the probe sampler (records prompts, fails on 'raise:'). Its tests fail
    calls on purpose, some in a row: the worker stays (test_worker_faults has the rule)."""
    env = {
        "SAMPLER": "tests.support.probe_sampler:ProbeSampler",
        "SAMPLING_UNHEALTHY_AFTER_FAILED_CALLS": "1000",
    }
    return start_stack("probe", env=env)


def batch_records(stack: Stack) -> list[dict[str, Any]]:
    aggregator = BatchAggregator(
        redis.Redis.from_url(stack.env["REDIS_URL"]), stack.env["SAMPLING_QUEUE"]
    )
    return [json.loads(raw) for raw in batch_log_of(aggregator).recent()]


def test_round_trip(service: Stack) -> None:
    reply = sample(service.base_url, "E equals ")
    assert (reply.status, reply.body) == (200, "MC squared")
    assert reply.headers["content-type"].startswith("text/plain")
    reply = sample(service.base_url, "For every action, there is ")
    assert (reply.status, reply.body) == (200, "an equal and opposite reaction")


def test_form_encoded_body_is_taken_raw(service: Stack) -> None:
    prompt = "a=1&b=two words"
    reply = sample(
        service.base_url, prompt, headers={"Content-Type": "application/x-www-form-urlencoded"}
    )
    assert (reply.status, reply.body) == (200, expected_completion(prompt))


def test_unicode_prompt(service: Stack) -> None:
    prompt = "Größe → 大きさ "
    reply = sample(service.base_url, prompt)
    assert (reply.status, reply.body) == (200, expected_completion(prompt))


def test_250_concurrent_requests_are_batched_and_answered_in_place(service: Stack) -> None:
    before = {r["batch_id"] for r in batch_records(service)}
    prompts = [f"concurrent prompt {i} {uuid.uuid4().hex[:6]}" for i in range(250)]
    sent = burst_until_answered(service.base_url, prompts)
    new = [r for r in batch_records(service) if r["batch_id"] not in before]
    # A 504's item may still be sampled after its request gave up: counted, not answered.
    assert sum(int(r["ok"]) for r in new) >= 250
    assert max(int(r["size"]) for r in new) <= 100
    assert len(new) <= sent / 10, f"{len(new)} batches for {sent} requests"


def test_bad_input_gets_a_4xx_with_a_reason(service: Stack) -> None:
    cases = {
        "empty": (b"", 400, "empty prompt"),
        "invalid utf-8": (b"\xff\xfeabc", 400, "not valid UTF-8"),
        "too long": (b"a" * 8193, 400, "over the 8192-byte limit"),
    }
    for name, (body, status, reason) in cases.items():
        reply = sample(service.base_url, body)
        assert reply.status == status, name
        assert reason in reply.body, name
        assert reply.body.count("\n") == 1, name  # one line
    assert sample(service.base_url, b"a" * 8192).status == 200  # the limit itself is allowed
    reply = request(service.base_url, "/sample", method="GET")
    assert reply.status == 405
    assert reply.headers["allow"] == "POST"
    assert request(service.base_url, "/sample", b"x", method="PUT").status == 405


def test_the_direct_paths_check_the_host_and_carry_djangos_security_headers(
    service: Stack,
) -> None:
    """/sample and the API skip Django's middleware (inference_site.direct): through gunicorn,
    a host outside ALLOWED_HOSTS still gets 400, and an answer the headers Django's stack puts
    on /healthz."""
    refused = sample(service.base_url, "E equals ", headers={"Host": "evil.example"})
    assert refused.status == 400
    answered = sample(service.base_url, "E equals ")
    through_django = request(service.base_url, "/healthz", method="GET")
    assert answered.status == through_django.status == 200
    for name in ("x-content-type-options", "referrer-policy", "cross-origin-opener-policy",
                 "x-frame-options"):  # fmt: skip
        expected = through_django.headers.get(name)
        assert expected, name
        assert answered.headers.get(name) == expected, name
    assert answered.headers["content-length"] == str(len(answered.body.encode()))


def test_health_and_readiness(service: Stack) -> None:
    assert request(service.base_url, "/healthz", method="GET").status == 200
    reply = request(service.base_url, "/readyz", method="GET")
    assert reply.status == 200
    assert "1 worker" in reply.body


def test_readiness_of_a_model_nobody_registered_is_a_404(service: Stack) -> None:
    """The probe is public behind the shipped nginx: a name the catalog does not hold gets a
    404, and no model is made for it (each held a Redis poller of its own, never freed)."""
    names = [f"no-such-{uuid.uuid4().hex}" for _ in range(UNKNOWN_READINESS_NAMES)]
    replies = [request(service.base_url, f"/readyz?model={name}", method="GET") for name in names]
    assert {reply.status for reply in replies} == {404}
    assert names[0] in replies[0].body
    assert request(service.base_url, "/readyz", method="GET").status == 200


def test_deadline_shorter_than_a_call_gives_504_and_never_reaches_the_sampler(
    probe: Stack, start_stack: Callable[..., Stack]
) -> None:
    # A second web node on the probe's queue with an 80 ms deadline, against 100 ms calls.
    deadline_s = 0.080
    hasty = start_stack(
        "hasty",
        env={
            "SAMPLING_QUEUE": probe.env["SAMPLING_QUEUE"],
            "SAMPLING_DEADLINE_MS": str(int(deadline_s * 1000)),
        },
        gpus=[],
    )
    prompts = [f"too late {i} {uuid.uuid4().hex[:6]}" for i in range(20)]
    expired_before = sum(int(r["expired"]) for r in batch_records(probe))
    with ThreadPoolExecutor(max_workers=20) as pool:
        # A first burst warms the new node's processes (their first requests load what a
        # request needs, tens of ms on a slow machine, during which the others wait in the
        # kernel: such a wait counts, and may get a request shed with a 503): only the second
        # is timed.
        warm_up = [f"warm-up {i} {uuid.uuid4().hex[:6]}" for i in range(20)]
        warm_replies = list(pool.map(lambda p: sample(hasty.base_url, p), warm_up))
        assert {r.status for r in warm_replies} <= {503, 504}, warm_replies
        replies = list(pool.map(lambda p: sample(hasty.base_url, p), prompts))
    # Each is a 504, or a fast 503 where this node refused it at once: it waited in the kernel
    # past the 80 ms less the least work a request needs (a busy machine), or admission
    # predicted a wait past 80 ms. Never an answer, never later than its deadline.
    late = [r for r in replies if r.status == 504]
    refused = [r for r in replies if r.status != 504]
    assert late, [(r.status, r.body) for r in replies]
    reasons = ("overloaded: the request waited", "overloaded: predicted")
    assert all(r.status == 503 and r.body.startswith(reasons) for r in refused), refused
    # Seen by the client: 20 connections opened at once on 2 shared cores reach the view one
    # after another, so the last ones start their deadline some ms after the client's timer.
    seconds = sorted(r.seconds for r in replies)
    assert seconds[len(seconds) // 2] < deadline_s + 0.040, seconds
    assert seconds[-1] < deadline_s + 0.080, seconds
    # The worker has dropped every 504's item: wait until it has sealed their batches, then look.
    client = redis.Redis.from_url(probe.env["REDIS_URL"])
    dropped = expired_before + sum(r.status == 504 for r in warm_replies) + len(late)
    wait_until(
        lambda: sum(int(r["expired"]) for r in batch_records(probe)) >= dropped,
        5,
        "every late prompt's batch sealed and dropped",
    )
    seen = {raw.decode() for raw in client.lrange(seen_key(probe.env["SAMPLING_QUEUE"]), 0, -1)}
    assert seen.isdisjoint(prompts + warm_up)
    # the probe itself still works with the normal deadline
    assert sample(probe.base_url, "E equals ").body == "MC squared"


def test_failing_sampler_gives_502_at_once_to_the_whole_batch(probe: Stack) -> None:
    prompts = ["raise: first"] + [f"raise: {i}" for i in range(9)]
    with ThreadPoolExecutor(max_workers=10) as pool:
        replies = list(pool.map(lambda p: sample(probe.base_url, p), prompts))
    for reply in replies:
        assert reply.status == 502, reply.body
        assert "sampler failed" in reply.body
        # two 100 ms calls at most, far from the 500 ms deadline
        assert reply.seconds < 0.4, reply.seconds
    # and the worker goes on serving the next batch
    assert sample(probe.base_url, "E equals ").body == "MC squared"


def test_stopped_worker_gives_504_at_the_deadline_and_unready(
    start_stack: Callable[..., Stack],
) -> None:
    stack = start_stack("stopped", env={"SAMPLER": "simulated"})
    assert sample(stack.base_url, "E equals ").status == 200
    stack.stop_process(stack.workers[0], signal.SIGKILL)  # a crash: no goodbye in Redis
    replies = [sample(stack.base_url, f"nobody home {i}") for i in range(3)]
    for reply in replies:
        assert reply.status == 504, reply.body
        assert 0.5 <= reply.seconds < 0.5 + 0.05, reply.seconds

    def unready() -> Any:
        reply = request(stack.base_url, "/readyz", method="GET")
        return reply if reply.status == 503 else None

    reply = wait_until(unready, 8, "/readyz unready")
    assert "no live worker" in reply.body
    # A probe's 503 is an answer, not a server error: not in the web log as one.
    assert stack.log_dir is not None
    web_log = (stack.log_dir / "web.log").read_text()
    assert "Service Unavailable: /readyz" not in web_log


def test_a_batch_whose_task_cannot_be_sent_is_closed_and_answered_at_once(
    start_stack: Callable[..., Stack],
) -> None:
    """The web node's broker is unreachable while the aggregator's Redis answers: every
    request gets a fast 503, and no later request joins a batch that no task will seal."""
    dead_broker = f"redis://127.0.0.1:{free_port()}/0"
    stack = start_stack("nobroker", env={"CELERY_BROKER_URL": dead_broker}, gpus=[])
    prompts = [f"undeliverable {i}" for i in range(20)]
    # No worker can reach the dead broker: one that heartbeats stands in for the workers of
    # a broker that just went away.
    with StalledWorker(stack.env["REDIS_URL"], stack.env["SAMPLING_QUEUE"]):
        wait_until(lambda: request(stack.base_url, "/readyz", method="GET").status == 200)
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            burst = list(pool.map(lambda p: sample(stack.base_url, p), prompts))
        one_by_one = [sample(stack.base_url, f"one by one {i}") for i in range(5)]
    deadline_s = Policy().deadline_ms / 1000
    for reply in burst + one_by_one:
        assert reply.status == 503, reply.body
        assert reply.headers["retry-after"] == "1"
        assert "batch queue unavailable" in reply.body  # refused: a timeout is a 504
    # Answered at once, not at the deadline: one by one each, and the burst's middle (20
    # dispatches that fail share the broker's connection pool, on a machine that may be busy).
    assert max(reply.seconds for reply in one_by_one) < deadline_s * 0.9, one_by_one
    assert statistics.median(reply.seconds for reply in burst) < deadline_s * 0.9, burst
    client = redis.Redis.from_url(stack.env["REDIS_URL"])
    keys = ShardKeys(stack.env["SAMPLING_QUEUE"])  # the one shard's tag is the queue's
    assert client.get(keys.open_batch) is None
    assert client.zcard(keys.unsealed) == 0
    assert client.zcard(keys.handover_due) == 0


def test_a_batch_left_by_a_dead_dispatcher_is_handed_over(service: Stack) -> None:
    """A web process died between opening a batch and sending its task: the next request
    after the grace sends it, and both the stranded member and the newcomer are answered."""
    client = redis.Redis.from_url(service.env["REDIS_URL"])
    aggregator = BatchAggregator(client, service.env["SAMPLING_QUEUE"])
    stranded = aggregator.append("stranded prompt", 2000)  # opened, never dispatched
    assert stranded.opened
    time.sleep(DISPATCH_GRACE_MS / 1000 + 0.05)  # duration: the dispatcher's grace runs out
    reply = sample(service.base_url, "the next request")
    assert (reply.status, reply.body) == (200, expected_completion("the next request"))
    app = Celery("stranded-member", set_as_current=False)
    app.conf.update(
        result_backend=f"batching.results:SharedListenerRedisBackend+{service.env['REDIS_URL']}",
        broker_url=service.env["REDIS_URL"],
    )
    results = app.AsyncResult(stranded.batch_id).get(timeout=2)
    assert results[stranded.index] == [ItemOutcome.OK, expected_completion("stranded prompt")]
