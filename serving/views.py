"""HTTP views: POST /sample, GET /healthz, GET /readyz, GET /metrics.

The request path never touches the database: one MULTI of plain commands to join a batch
(the only Redis round trip of a request), one Celery publish (by task name) and one confirmation for
the request that opened it, and a wait on the batch's result through the process's shared
result listener, which is subscribed already (serving.submission); serving.wrappers makes
the view of it. The OpenAI-compatible API
and /api/inference are in serving.api.
"""

from __future__ import annotations

import logging

from django.http import HttpRequest, HttpResponse
from prometheus_client import CONTENT_TYPE_LATEST

from accounts.access import Caller
from batching.outcomes import RequestOutcome
from batching.problems import Failure
from batching.topology import REDIS_FAULTS
from serving import metrics
from serving.deadline import Deadline
from serving.responses import Invalid, openai_invalid
from serving.routing import Route, Unrouted, route, sticky_of
from serving.runtime import ServedModel, WebProcess, web_process
from serving.streams import Ends, text_stream
from serving.submission import charge, enter
from serving.wrappers import Handled, answer_failure, counted, submitted, unrouted

log = logging.getLogger(__name__)

# `/sample?stream=1` (or `true`): the text as it is sampled.
STREAM_VALUES = ("1", "true")


def _text(status: int, body: str, **headers: str) -> HttpResponse:
    response = HttpResponse(body, status=status, content_type="text/plain; charset=utf-8")
    for name, value in headers.items():
        response[name.replace("_", "-")] = value
    return response


def _reason(status: int, reason: str, **headers: str) -> HttpResponse:
    return _text(status, reason + "\n", **headers)


def _sample(request: HttpRequest, process: WebProcess, arrival: float, caller: Caller) -> Handled:
    if request.method != "POST":
        return _bad(_reason(405, "use POST with the prompt as the request body", Allow="POST"))
    try:
        found = route(process, request.GET.get("model"), sticky=sticky_of(caller, None))
    except Invalid as invalid:
        return _bad(_reason(invalid.status, str(invalid)))
    if isinstance(found, Unrouted):
        return unrouted(_failure, found)
    model = found.served
    policy = model.watcher.current  # this process's copy, refreshed in the background
    max_bytes = policy.max_prompt_bytes
    too_long = f"prompt is over the {max_bytes}-byte limit (max prompt bytes of the policy)"
    declared = request.META.get("CONTENT_LENGTH") or "0"
    if declared.isdigit() and int(declared) > max_bytes:
        return _bad(_reason(400, too_long), model)
    body = request.body  # the raw body whatever the content type (curl -d says form-encoded)
    if not body:
        return _bad(_reason(400, "empty prompt: send the prompt as the request body"), model)
    if len(body) > max_bytes:
        return _bad(_reason(400, too_long), model)
    try:
        prompt = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return _bad(_reason(400, f"prompt is not valid UTF-8 (byte {exc.start})"), model)

    deadline = Deadline(arrival, policy.deadline_ms)
    if request.GET.get("stream") in STREAM_VALUES:
        return _stream(request, found, caller, prompt, deadline)
    sticky = sticky_of(caller, None)
    found, answers = submitted(found, caller, [prompt], deadline, sticky)
    model = found.served
    if isinstance(answers, Failure):
        return Handled(answers.outcome, answer_failure(_failure, answers), model)
    charge(model.stats, caller, answers, found.entry.price)
    return Handled(RequestOutcome.OK, _text(200, answers[0].text, **answers.headers()), model)


def _stream(
    request: HttpRequest, found: Route, caller: Caller, prompt: str, deadline: Deadline
) -> Handled:
    """`?stream=1`: the prompt's text as it is sampled, plain, chunked (serving.streams)."""
    model = found.served
    entered = enter(model, caller, [prompt], deadline, stream=True, price=found.entry.price)
    if isinstance(entered, Failure):
        return Handled(entered.outcome, answer_failure(_failure, entered), model)
    ends = Ends.of(request, model, caller, found.entry.price)
    response, stream = text_stream(ends, entered, deadline)
    return Handled(RequestOutcome.OK, response, model, stream)


def _bad(response: HttpResponse, model: ServedModel | None = None) -> Handled:
    return Handled(RequestOutcome.BAD_REQUEST, response, model)


def _failure(failure: Failure) -> HttpResponse:
    return _reason(failure.status, failure.message)


sample = counted(_sample, _failure)


def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus exposition: every web process of this node, and every model's workers and
    GPU recommendation."""
    process = web_process()
    models = [
        (name, process.model(name).watcher.current) for name in process.catalog.current.models
    ]
    return HttpResponse(
        metrics.exposition(process.client, models), content_type=CONTENT_TYPE_LATEST
    )


def healthz(request: HttpRequest) -> HttpResponse:
    return _text(200, "ok\n")


def readyz(request: HttpRequest) -> HttpResponse:
    """Ready when Redis answers and the default model (or `?model=`'s) has a live worker: a
    web process serves every model, and one model without a worker must not take the
    others' traffic away with the web pods (its requests get a fast 503 instead). A name
    the catalog does not hold is a 404 that leaves nothing behind (the probe is public)."""
    process = web_process()
    name = request.GET.get("model") or process.default_model
    if name != process.default_model and name not in process.catalog.current.models:
        return _reason(404, f"no model {name[:100]!r} in the catalog")
    try:
        process.client.ping()
        workers = process.model(name).read_live_workers()
    except REDIS_FAULTS as exc:  # on a cluster, RedisClusterException is not a RedisError
        return _not_ready(f"not ready: Redis does not answer ({type(exc).__name__})")
    if workers == 0:
        return _not_ready(f"not ready: no live worker for queue {name!r}")
    return _text(200, f"ready: {workers} worker(s) for queue {name!r}\n")


def _not_ready(reason: str) -> HttpResponse:
    response = _reason(503, reason)
    # A probe's answer, polled every second or so (and during a model's load at start), not
    # a server error: keep it out of django.request's ERROR log.
    response._has_been_logged = True  # type: ignore[attr-defined]
    return response


def bad_request(request: HttpRequest, exception: Exception) -> HttpResponse:
    """Django's 400 (a body its parsers refuse: a multipart upload without a boundary, a
    file name past the limits) in the API's own words: OpenAI's error JSON under /v1/."""
    reason = f"the request cannot be read: {str(exception)[:200] or type(exception).__name__}"
    if request.path.startswith("/v1/"):
        return openai_invalid(Invalid(reason, code="invalid_request"))
    return _reason(400, reason)
