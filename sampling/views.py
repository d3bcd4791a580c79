"""HTTP views: POST /sample, GET /healthz, GET /readyz, GET /metrics.

The request path never touches the database: one Lua call to join a batch, one Celery
publish for the request that opened it, and a wait on the batch's result through the
process's shared result listener.
"""

from __future__ import annotations

import logging
import math
import time
import uuid

import redis
from celery.exceptions import TimeoutError as CeleryTimeoutError
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from prometheus_client import CONTENT_TYPE_LATEST

from inference_site.celery import app as celery_app
from sampling import metrics, stats
from sampling.aggregator import EXPIRED, OK, REJECTED
from sampling.connections import WebProcess, web_process
from sampling.stats import BAD_REQUEST, ERROR, TIMEOUT
from sampling.stats import REJECTED as REJECTED_OVERLOAD
from workers.tasks import run_batch

log = logging.getLogger(__name__)


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


def _sample(request: HttpRequest, process: WebProcess, arrival: float) -> tuple[str, HttpResponse]:
    if request.method != "POST":
        return BAD_REQUEST, _reason(
            405, "use POST with the prompt as the request body", Allow="POST"
        )
    policy = process.watcher.current  # this process's copy, refreshed in the background
    max_bytes = policy.max_prompt_bytes
    too_long = f"prompt is over the {max_bytes}-byte limit (max prompt bytes of the policy)"
    declared = request.META.get("CONTENT_LENGTH") or "0"
    if declared.isdigit() and int(declared) > max_bytes:
        return BAD_REQUEST, _reason(400, too_long)
    body = request.body  # the raw body whatever the content type (curl -d says form-encoded)
    if not body:
        return BAD_REQUEST, _reason(400, "empty prompt: send the prompt as the request body")
    if len(body) > max_bytes:
        return BAD_REQUEST, _reason(400, too_long)
    try:
        prompt = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return BAD_REQUEST, _reason(400, f"prompt is not valid UTF-8 (byte {exc.start})")

    deadline_ms = policy.deadline_ms
    deadline = arrival + deadline_ms / 1000
    aggregator = process.aggregator
    try:
        budget_ms = int((deadline - time.monotonic()) * 1000)
        ticket = aggregator.append(uuid.uuid4().hex, prompt, budget_ms)
    except redis.RedisError as exc:
        log.error("cannot reach Redis to queue a request: %s", exc)
        return ERROR, _reason(503, "batch queue unavailable", Retry_After="1")
    if ticket.rejected:
        retry_after = str(max(1, math.ceil(ticket.predicted_ms / 1000)))
        return REJECTED_OVERLOAD, _reason(
            503,
            f"overloaded: predicted {ticket.predicted_ms} ms exceeds the {deadline_ms} ms deadline",
            Retry_After=retry_after,
        )

    if ticket.opened:
        try:
            run_batch.apply_async(
                (ticket.batch_id, aggregator.queue),
                task_id=ticket.batch_id,
                queue=aggregator.queue,
            )
        except Exception as exc:  # the broker is the same Redis: it is down or overloaded
            log.error("cannot dispatch batch %s: %s", ticket.batch_id, exc)
            return ERROR, _reason(503, "batch queue unavailable", Retry_After="1")

    try:
        results = celery_app.AsyncResult(ticket.batch_id).get(
            timeout=max(0.0, deadline - time.monotonic())
        )
        outcome, text = results[ticket.index]
    except CeleryTimeoutError:
        return TIMEOUT, _reason(504, f"no completion within the {deadline_ms} ms deadline")
    except Exception as exc:
        log.error("batch %s failed: %s", ticket.batch_id, exc)
        return ERROR, _reason(502, "the sampler failed for this batch")

    if outcome == OK:
        return stats.OK, _text(200, text)
    if outcome == EXPIRED:
        return TIMEOUT, _reason(504, f"no completion within the {deadline_ms} ms deadline ({text})")
    if outcome == REJECTED:
        return BAD_REQUEST, _reason(400, f"prompt rejected by the model: {text}")
    return ERROR, _reason(502, text)


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
