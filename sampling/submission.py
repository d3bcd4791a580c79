"""A request's items through the batches: join, dispatch, wait. Shared by every endpoint.

Each item joins its shard's open batch with the request's one Redis round trip (one per item:
a list prompt or `n` choices are several items, each its own row of a batch); the request
that opened a batch sends its Celery task (by name, task id = batch id) and confirms it; then
the request waits on each batch's result through the process's shared result listener, with
what is left of its deadline. What the request gets is every item's answer, or one `Failure`
that each endpoint words in its own format (plain text on /sample, OpenAI's error JSON on
/v1, the seed design's JSON on /api/inference).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import redis
from celery.backends.redis import RedisBackend
from celery.exceptions import TimeoutError as CeleryTimeoutError
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt

from batching import cache
from batching.access import Caller
from batching.generation import SampleRequest
from batching.outcomes import ItemOutcome, RequestOutcome
from batching.protocol import RUN_BATCH_TASK, task_priority
from batching.ratelimit import RateCounter
from batching.results import queue_result
from inference_site.celery import app as celery_app
from sampling import metrics
from sampling.runtime import WebProcess, web_process
from sampling.shedding import ShedReason

log = logging.getLogger(__name__)

QUEUE_UNAVAILABLE = "batch queue unavailable"
# One quick reconnect (a pooled connection gone stale after a broker restart), no more: a
# broker that refuses twice is not back within a deadline. Celery's default retries for ~1 s.
PUBLISH_RETRY = {"max_retries": 1, "interval_start": 0, "interval_step": 0.05, "interval_max": 0.05}


class Problem(StrEnum):
    """Why a request got no completion: one vocabulary, worded by each endpoint."""

    OVERLOADED = "overloaded"  # 503 + Retry-After: admission predicts a missed deadline
    UNAVAILABLE = "unavailable"  # 503 + Retry-After: Redis or the broker cannot be reached
    DEADLINE = "deadline"  # 504: no completion within the deadline
    PROMPT_REJECTED = "prompt_rejected"  # 400: the model refused the prompt (too long...)
    SAMPLER_FAILED = "sampler_failed"  # 502: the sampler failed for the batch
    UNAUTHORIZED = "unauthorized"  # 401: no valid API key
    RATE_LIMITED = "rate_limited"  # 429 + Retry-After: the key is over its rate limit


STATUS = {
    Problem.OVERLOADED: 503,
    Problem.UNAVAILABLE: 503,
    Problem.DEADLINE: 504,
    Problem.PROMPT_REJECTED: 400,
    Problem.SAMPLER_FAILED: 502,
    Problem.UNAUTHORIZED: 401,
    Problem.RATE_LIMITED: 429,
}
OUTCOME = {
    Problem.OVERLOADED: RequestOutcome.REJECTED,
    Problem.UNAVAILABLE: RequestOutcome.ERROR,
    Problem.DEADLINE: RequestOutcome.TIMEOUT,
    Problem.PROMPT_REJECTED: RequestOutcome.BAD_REQUEST,
    Problem.SAMPLER_FAILED: RequestOutcome.ERROR,
    Problem.UNAUTHORIZED: RequestOutcome.UNAUTHORIZED,
    Problem.RATE_LIMITED: RequestOutcome.RATE_LIMITED,
}


@dataclass(frozen=True)
class Failure:
    problem: Problem
    message: str  # one line, for the client
    retry_after_s: int = 0  # 503 and 429: when to try again

    @property
    def status(self) -> int:
        return STATUS[self.problem]

    @property
    def outcome(self) -> RequestOutcome:
        return OUTCOME[self.problem]


Handler = Callable[[HttpRequest, WebProcess, float, Caller], tuple[RequestOutcome, HttpResponse]]
Words = Callable[[Failure], HttpResponse]  # how an endpoint says a Failure


def authenticate(request: HttpRequest, process: WebProcess) -> Caller | Failure:
    """The request's caller, from its Authorization header and this process's copy of the
    keys (no Redis call): a 401 Failure for a missing key (when SAMPLING_REQUIRE_API_KEY is
    on), a malformed header, or an unknown, revoked or expired key; anonymous otherwise."""
    found = process.access.identify(
        request.META.get("HTTP_AUTHORIZATION"), settings.SAMPLING_REQUIRE_API_KEY
    )
    if isinstance(found, Caller):
        return found
    if found is None:  # the keys were never read: Redis away since this process started
        return Failure(Problem.UNAVAILABLE, "API keys cannot be checked yet", 1)
    return Failure(Problem.UNAUTHORIZED, str(found))


def answer_failure(words: Words, failure: Failure) -> HttpResponse:
    """An endpoint's wording of `failure`, with the headers its status asks for."""
    response = words(failure)
    if failure.retry_after_s:
        response["Retry-After"] = str(failure.retry_after_s)
    if failure.status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="sampling"'
    return response


def counted(handle: Handler, words: Words) -> Callable[[HttpRequest], HttpResponse]:
    """A view around `handle(request, process, arrival, caller)`: the request shed first if
    this process cannot start it in time (sampling.shedding), its deadline counted from its
    arrival (`X-Request-Start`, else when its bytes reached the kernel, else now); then the
    caller authenticated and checked against its rate limits first (a refusal worded by
    `words`), every answer to a limited caller with its x-ratelimit-* headers, and every
    request counted in memory (statistics flushed to Redis once a second) and in this
    process's Prometheus file, with no round trip on the request path. CSRF does not apply
    to the API (no cookies)."""

    @csrf_exempt
    def view(request: HttpRequest) -> HttpResponse:
        process = web_process()
        shedder = process.shedder
        arrival = shedder.arrival(request.META)  # the deadline counts from here
        deadline_ms = process.watcher.current.deadline_ms
        shed = shedder.refusal(arrival, deadline_ms)
        caller: Caller | Failure
        if shed is not None:
            caller = _shed(shed, arrival, deadline_ms, shedder.max_in_flight)
            metrics.record_shed(shed)
            outcome, response = caller.outcome, answer_failure(words, caller)
        else:
            shedder.in_flight += 1
            try:
                caller = authenticate(request, process)
                if isinstance(caller, Failure):
                    outcome, response = caller.outcome, answer_failure(words, caller)
                else:
                    limited = process.limiter.check(caller)
                    if limited is not None:
                        refusal = Failure(
                            Problem.RATE_LIMITED, limited.message, limited.retry_after_s
                        )
                        outcome, response = refusal.outcome, answer_failure(words, refusal)
                    else:
                        outcome, response = handle(request, process, arrival, caller)
                    for header, value in process.limiter.headers(caller).items():
                        response[header] = value
            finally:
                shedder.in_flight -= 1
        latency_s = time.monotonic() - arrival
        key_id = 0 if isinstance(caller, Failure) else caller.key_id
        tier = "" if isinstance(caller, Failure) else caller.tier
        process.stats.record(outcome, latency_s, key_id=key_id, tier=tier)
        metrics.record_request(outcome, latency_s, tier)
        return response

    view.__name__ = view.__qualname__ = handle.__name__.lstrip("_")
    return view


def _shed(reason: ShedReason, arrival: float, deadline_ms: int, max_in_flight: int) -> Failure:
    if reason == ShedReason.IN_FLIGHT:
        message = f"overloaded: this web process holds {max_in_flight} requests already"
    else:
        waited_ms = (time.monotonic() - arrival) * 1000
        message = (
            f"overloaded: the request waited {waited_ms:.0f} ms of its {deadline_ms} ms "
            "deadline before this server could start it"
        )
    return Failure(Problem.OVERLOADED, message, 1)


def _unavailable() -> Failure:
    return Failure(Problem.UNAVAILABLE, QUEUE_UNAVAILABLE, 1)


class Answers(list[list[Any]]):
    """A request's answers, one per item, and what the response cache did for it: "hit" (every
    item answered from it), "miss" (some item sampled), or "" (the cache not asked)."""

    cache: str = ""

    def cache_header(self, response: HttpResponse) -> HttpResponse:
        if self.cache:
            response["x-cache"] = self.cache
        return response


def submit(
    process: WebProcess,
    caller: Caller,
    items: Sequence[str | SampleRequest],
    deadline: float,
    deadline_ms: int,
) -> Answers | Failure:
    """Every item's answer ([ItemOutcome.OK, text, ...] each, in order), or why the request
    gets none. `deadline` is monotonic; `deadline_ms` the policy's, for messages. The items of
    a caller with a request limit join its key's shard, and the first raises its counter
    (batching.ratelimit). With the response cache on, an item whose output its input
    determines is looked up in the same call (batching.cache): a hit joins no batch."""
    aggregator, limiter = process.aggregator, process.limiter
    shard = aggregator.shard_of_key(caller.key_id) if caller.rpm else None
    now_s = time.time()
    counter_key = limiter.counter(caller, aggregator.shards[shard or 0], now_s)
    counter = RateCounter(counter_key, limiter.needs_expiry(caller, now_s)) if counter_key else None
    policy = process.watcher.current
    digests = [cache.digest_of(aggregator.queue, item, policy) for item in items]
    tickets = []
    for item, digest in zip(items, digests, strict=True):
        try:
            ticket = aggregator.append(
                item,
                int((deadline - time.monotonic()) * 1000),
                shard,
                key_id=caller.key_id,
                counter=counter,
                cache=digest,
                lane=caller.priority,
            )
        except redis.RedisError as exc:
            log.error("cannot reach Redis to queue a request: %s", exc)
            return _unavailable()
        if ticket.rejected:
            return Failure(
                Problem.OVERLOADED,
                f"overloaded: predicted {ticket.predicted_ms} ms exceeds the {deadline_ms} ms "
                "deadline",
                max(1, math.ceil(ticket.predicted_ms / 1000)),
            )
        if ticket.counted and counter is not None:
            limiter.counted(caller, ticket.counted, now_s, expiry_set=bool(counter.expire_ms))
            counter = None  # one request, one count: its other items join without
        if ticket.opened and not _dispatch(process, ticket.batch_id, ticket.lane):
            return _unavailable()
        tickets.append(ticket)

    answers = Answers()
    asked = sum(1 for digest in digests if digest)
    if asked:
        hits = sum(1 for ticket in tickets if ticket.cached is not None)
        answers.cache = "hit" if hits == len(items) else "miss"
        process.stats.record_cache(hits, asked - hits)
        metrics.record_cache(hits, asked - hits)
    batches: dict[str, list[list[Any]]] = {}  # several items may share a batch
    for ticket in tickets:
        if ticket.cached is not None:
            answers.append(json.loads(ticket.cached))
            continue
        try:
            results = batches.get(ticket.batch_id)
            if results is None:
                results = batches[ticket.batch_id] = celery_app.AsyncResult(ticket.batch_id).get(
                    timeout=max(0.0, deadline - time.monotonic())
                )
            answer = results[ticket.index]
        except CeleryTimeoutError:
            return Failure(Problem.DEADLINE, f"no completion within the {deadline_ms} ms deadline")
        except redis.RedisError as exc:  # the batch's Redis node went down while it waited
            log.error("batch %s: its results cannot arrive: %s", ticket.batch_id, exc)
            return _unavailable()
        except Exception as exc:  # noqa: BLE001 - whatever broke the batch: a 502
            log.error("batch %s failed: %s", ticket.batch_id, exc)
            return Failure(Problem.SAMPLER_FAILED, "the sampler failed for this batch")
        failure = _failure_of(answer, deadline_ms)
        if failure is not None:
            return failure
        answers.append(answer)
    return answers


def _failure_of(answer: list[Any], deadline_ms: int) -> Failure | None:
    outcome, text = answer[0], answer[1]
    if outcome == ItemOutcome.OK:
        return None
    if outcome == ItemOutcome.EXPIRED:
        return Failure(
            Problem.DEADLINE, f"no completion within the {deadline_ms} ms deadline ({text})"
        )
    if outcome == ItemOutcome.PROMPT_REJECTED:
        return Failure(Problem.PROMPT_REJECTED, f"prompt rejected by the model: {text}")
    if outcome == ItemOutcome.NOT_DISPATCHED:
        return _unavailable()
    return Failure(Problem.SAMPLER_FAILED, str(text))


def _dispatch(process: WebProcess, batch_id: str, lane: int) -> bool:
    """Send the batch's task (task id = batch id, by name: no import of the worker's code), at
    its lane's Celery priority. When it cannot be sent, close the batch so that no later
    request joins it, and answer the members that joined already at once rather than at
    their deadline."""
    aggregator = process.aggregator
    try:
        celery_app.send_task(
            RUN_BATCH_TASK,
            args=(batch_id, aggregator.queue, lane),
            task_id=batch_id,
            queue=aggregator.queue,
            priority=task_priority(lane),
            retry_policy=PUBLISH_RETRY,
            # A message older than its batch's data is stale work: a worker drops it unrun
            # (after a broker outage, say) instead of sealing what has expired.
            expires=aggregator.ttl_s,
        )
    except Exception as exc:  # noqa: BLE001 - kombu raises OperationalError, OSError and more
        log.error("cannot dispatch batch %s: %s", batch_id, exc)
        _abandon(process, batch_id, lane)
        return False
    try:
        aggregator.dispatched(batch_id, lane)
    except redis.RedisError as exc:
        # Harmless: a later request sends the task again, and the duplicate answers nothing.
        log.warning("batch %s dispatched but not confirmed: %s", batch_id, exc)
    return True


def _abandon(process: WebProcess, batch_id: str, lane: int) -> None:
    aggregator = process.aggregator
    try:
        members = aggregator.abandon(batch_id, lane)
        answers = [[ItemOutcome.NOT_DISPATCHED, QUEUE_UNAVAILABLE] for _ in range(members)]
        # Stored and published as the task would have: every member's wait wakes now.
        backend = celery_app.backend
        assert isinstance(backend, RedisBackend)  # CELERY_RESULT_BACKEND is ours
        with process.client.pipeline(transaction=False) as pipe:
            queue_result(pipe, backend, batch_id, answers, expires_s=aggregator.ttl_s)
            pipe.execute()
    except Exception as exc:  # noqa: BLE001 - Redis down too: the members time out instead
        log.error("batch %s abandoned, its members not answered: %s", batch_id, exc)
