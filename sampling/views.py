"""HTTP views: POST /sample, GET /healthz, GET /readyz, GET /metrics.

The request path never touches the database: one MULTI of plain commands to join a batch
(the only Redis round trip of a request), one Celery publish (by task name) and one confirmation for
the request that opened it, and a wait on the batch's result through the process's shared
result listener, which is subscribed already.
"""

from __future__ import annotations

import logging
import math
import time

import redis
from celery.backends.redis import RedisBackend
from celery.exceptions import TimeoutError as CeleryTimeoutError
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from prometheus_client import CONTENT_TYPE_LATEST

from batching.outcomes import ItemOutcome, RequestOutcome
from batching.protocol import RUN_BATCH_TASK
from batching.results import queue_result
from inference_site.celery import app as celery_app
from sampling import metrics
from sampling.runtime import WebProcess, web_process

log = logging.getLogger(__name__)

QUEUE_UNAVAILABLE = "batch queue unavailable"
# One quick reconnect (a pooled connection gone stale after a broker restart), no more: a
# broker that refuses twice is not back within a deadline. Celery's default retries for ~1 s.
PUBLISH_RETRY = {"max_retries": 1, "interval_start": 0, "interval_step": 0.05, "interval_max": 0.05}


def _text(status: int, body: str, **headers: str) -> HttpResponse:
    response = HttpResponse(body, status=status, content_type="text/plain; charset=utf-8")
    for name, value in headers.items():
        response[name.replace("_", "-")] = value
    return response


def _reason(status: int, reason: str, **headers: str) -> HttpResponse:
    return _text(status, reason + "\n", **headers)


@csrf_exempt
def sample(request: HttpRequest) -> HttpResponse:
    arrival = time.monotonic()
    process = web_process()
    outcome, response = _sample(request, process, arrival)
    # Counted in memory (flushed to Redis once a second) and in this process's Prometheus
    # file: no round trip on the request path.
    latency_s = time.monotonic() - arrival
    process.stats.record(outcome, latency_s)
    metrics.record_request(outcome, latency_s)
    return response


def _sample(
    request: HttpRequest, process: WebProcess, arrival: float
) -> tuple[RequestOutcome, HttpResponse]:
    if request.method != "POST":
        return RequestOutcome.BAD_REQUEST, _reason(
            405, "use POST with the prompt as the request body", Allow="POST"
        )
    policy = process.watcher.current  # this process's copy, refreshed in the background
    max_bytes = policy.max_prompt_bytes
    too_long = f"prompt is over the {max_bytes}-byte limit (max prompt bytes of the policy)"
    declared = request.META.get("CONTENT_LENGTH") or "0"
    if declared.isdigit() and int(declared) > max_bytes:
        return RequestOutcome.BAD_REQUEST, _reason(400, too_long)
    body = request.body  # the raw body whatever the content type (curl -d says form-encoded)
    if not body:
        return RequestOutcome.BAD_REQUEST, _reason(
            400, "empty prompt: send the prompt as the request body"
        )
    if len(body) > max_bytes:
        return RequestOutcome.BAD_REQUEST, _reason(400, too_long)
    try:
        prompt = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return RequestOutcome.BAD_REQUEST, _reason(
            400, f"prompt is not valid UTF-8 (byte {exc.start})"
        )

    deadline_ms = policy.deadline_ms
    deadline = arrival + deadline_ms / 1000
    try:
        ticket = process.aggregator.append(prompt, int((deadline - time.monotonic()) * 1000))
    except redis.RedisError as exc:
        log.error("cannot reach Redis to queue a request: %s", exc)
        return RequestOutcome.ERROR, _reason(503, QUEUE_UNAVAILABLE, Retry_After="1")
    if ticket.rejected:
        return RequestOutcome.REJECTED, _reason(
            503,
            f"overloaded: predicted {ticket.predicted_ms} ms exceeds the {deadline_ms} ms deadline",
            Retry_After=str(max(1, math.ceil(ticket.predicted_ms / 1000))),
        )
    if ticket.opened and not _dispatch(process, ticket.batch_id):
        return RequestOutcome.ERROR, _reason(503, QUEUE_UNAVAILABLE, Retry_After="1")

    try:
        results = celery_app.AsyncResult(ticket.batch_id).get(
            timeout=max(0.0, deadline - time.monotonic())
        )
        outcome, text = results[ticket.index]
    except CeleryTimeoutError:
        return RequestOutcome.TIMEOUT, _reason(
            504, f"no completion within the {deadline_ms} ms deadline"
        )
    except redis.RedisError as exc:  # the batch's Redis node went down while it waited
        log.error("batch %s: its results cannot arrive: %s", ticket.batch_id, exc)
        return RequestOutcome.ERROR, _reason(503, QUEUE_UNAVAILABLE, Retry_After="1")
    except Exception as exc:  # noqa: BLE001 - whatever broke the batch, this request gets a 502
        log.error("batch %s failed: %s", ticket.batch_id, exc)
        return RequestOutcome.ERROR, _reason(502, "the sampler failed for this batch")

    if outcome == ItemOutcome.OK:
        return RequestOutcome.OK, _text(200, text)
    if outcome == ItemOutcome.EXPIRED:
        return RequestOutcome.TIMEOUT, _reason(
            504, f"no completion within the {deadline_ms} ms deadline ({text})"
        )
    if outcome == ItemOutcome.PROMPT_REJECTED:
        return RequestOutcome.BAD_REQUEST, _reason(400, f"prompt rejected by the model: {text}")
    if outcome == ItemOutcome.NOT_DISPATCHED:
        return RequestOutcome.ERROR, _reason(503, QUEUE_UNAVAILABLE, Retry_After="1")
    return RequestOutcome.ERROR, _reason(502, text)


def _dispatch(process: WebProcess, batch_id: str) -> bool:
    """Send the batch's task (task id = batch id, by name: no import of the worker's code).
    When it cannot be sent, close the batch so that no later request joins it, and answer
    the members that joined already at once rather than at their deadline."""
    aggregator = process.aggregator
    try:
        celery_app.send_task(
            RUN_BATCH_TASK,
            args=(batch_id, aggregator.queue),
            task_id=batch_id,
            queue=aggregator.queue,
            retry_policy=PUBLISH_RETRY,
        )
    except Exception as exc:  # noqa: BLE001 - kombu raises OperationalError, OSError and more
        log.error("cannot dispatch batch %s: %s", batch_id, exc)
        _abandon(process, batch_id)
        return False
    try:
        aggregator.dispatched(batch_id)
    except redis.RedisError as exc:
        # Harmless: a later request sends the task again, and the duplicate answers nothing.
        log.warning("batch %s dispatched but not confirmed: %s", batch_id, exc)
    return True


def _abandon(process: WebProcess, batch_id: str) -> None:
    try:
        members = process.aggregator.abandon(batch_id)
        answers = [[ItemOutcome.NOT_DISPATCHED, QUEUE_UNAVAILABLE] for _ in range(members)]
        # Stored and published as the task would have: every member's wait wakes now.
        backend = celery_app.backend
        assert isinstance(backend, RedisBackend)  # CELERY_RESULT_BACKEND is ours
        with process.client.pipeline(transaction=False) as pipe:
            queue_result(pipe, backend, batch_id, answers)
            pipe.execute()
    except Exception as exc:  # noqa: BLE001 - Redis down too: the members time out instead
        log.error("batch %s abandoned, its members not answered: %s", batch_id, exc)


def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus exposition: every web process of this node, and every worker of the queue."""
    process = web_process()
    return HttpResponse(
        metrics.exposition(process.client, process.aggregator.queue),
        content_type=CONTENT_TYPE_LATEST,
    )


def healthz(request: HttpRequest) -> HttpResponse:
    return _text(200, "ok\n")


def readyz(request: HttpRequest) -> HttpResponse:
    aggregator = web_process().aggregator
    try:
        aggregator.client.ping()
        workers = aggregator.live_workers()
    except redis.RedisError as exc:
        return _not_ready(f"not ready: Redis does not answer ({type(exc).__name__})")
    if workers == 0:
        return _not_ready(f"not ready: no live worker for queue {aggregator.queue!r}")
    return _text(200, f"ready: {workers} worker(s) for queue {aggregator.queue!r}\n")


def _not_ready(reason: str) -> HttpResponse:
    response = _reason(503, reason)
    # A probe's answer, polled every second or so (and during a model's load at start), not
    # a server error: keep it out of django.request's ERROR log.
    response._has_been_logged = True  # type: ignore[attr-defined]
    return response
