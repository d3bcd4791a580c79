"""HTTP views: POST /sample, GET /healthz, GET /readyz.

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
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt

from inference_site.celery import app as celery_app
from sampling.aggregator import EXPIRED, OK, REJECTED, BatchAggregator
from sampling.connections import aggregator as process_aggregator
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
    if request.method != "POST":
        return _reason(405, "use POST with the prompt as the request body", Allow="POST")

    max_bytes = settings.SAMPLING_MAX_PROMPT_BYTES
    declared = request.META.get("CONTENT_LENGTH") or "0"
    if declared.isdigit() and int(declared) > max_bytes:
        return _reason(400, f"prompt is over SAMPLING_MAX_PROMPT_BYTES ({max_bytes} bytes)")
    body = request.body  # the raw body whatever the content type (curl -d says form-encoded)
    if not body:
        return _reason(400, "empty prompt: send the prompt as the request body")
    if len(body) > max_bytes:
        return _reason(400, f"prompt is over SAMPLING_MAX_PROMPT_BYTES ({max_bytes} bytes)")
    try:
        prompt = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return _reason(400, f"prompt is not valid UTF-8 (byte {exc.start})")

    deadline_ms = settings.SAMPLING_DEADLINE_MS
    deadline = arrival + deadline_ms / 1000
    aggregator: BatchAggregator = process_aggregator()
    try:
        budget_ms = int((deadline - time.monotonic()) * 1000)
        ticket = aggregator.append(uuid.uuid4().hex, prompt, budget_ms)
    except redis.RedisError as exc:
        log.error("cannot reach Redis to queue a request: %s", exc)
        return _reason(503, "batch queue unavailable", Retry_After="1")
    if ticket.rejected:
        retry_after = str(max(1, math.ceil(ticket.predicted_ms / 1000)))
        return _reason(
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
            return _reason(503, "batch queue unavailable", Retry_After="1")

    try:
        results = celery_app.AsyncResult(ticket.batch_id).get(
            timeout=max(0.0, deadline - time.monotonic())
        )
        outcome, text = results[ticket.index]
    except CeleryTimeoutError:
        return _reason(504, f"no completion within the {deadline_ms} ms deadline")
    except Exception as exc:
        log.error("batch %s failed: %s", ticket.batch_id, exc)
        return _reason(502, "the sampler failed for this batch")

    if outcome == OK:
        return _text(200, text)
    if outcome == EXPIRED:
        return _reason(504, f"no completion within the {deadline_ms} ms deadline ({text})")
    if outcome == REJECTED:
        return _reason(400, f"prompt rejected by the model: {text}")
    return _reason(502, text)


def healthz(request: HttpRequest) -> HttpResponse:
    return _text(200, "ok\n")


def readyz(request: HttpRequest) -> HttpResponse:
    aggregator = process_aggregator()
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
