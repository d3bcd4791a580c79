"""The JSON API's endpoints: OpenAI-compatible /v1 (completions, chat, models, the OpenAPI
document) and /api/inference.

Each request is read and checked against the policy this process applies
(serving.validation), its prompts and choices become items of the batches (one
batching.generation.SampleRequest per prompt and choice, each with its own settings), and its
answers come back through the same path as /sample's (serving.submission), shaped as OpenAI's
(serving.completions). Errors are JSON in each API's shape (serving.responses); nothing here
touches the database, and the request costs Redis what /sample costs per item.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from functools import cache
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt

from accounts.access import Caller
from batching.generation import SampleRequest
from batching.outcomes import RequestOutcome
from batching.policy import Policy
from batching.problems import Failure
from batching.registry import HEARTBEAT_TIMEOUT_MS
from batching.topology import REDIS_FAULTS
from serving import schemas
from serving.completions import completion_response
from serving.deadline import Deadline
from serving.openapi import openapi_document
from serving.responses import (
    JSON,
    Invalid,
    inference_failure,
    inference_invalid,
    json_response,
    openai_error,
    openai_failure,
    openai_invalid,
)
from serving.routing import Route, Unrouted, route, sticky_of
from serving.runtime import WebProcess, web_process
from serving.streams import Ends, completion_stream
from serving.submission import charge, enter, submit
from serving.validation import (
    check_settings,
    check_size,
    parse,
    read_body,
    sample_requests,
)
from serving.wrappers import (
    Handled,
    answer_failure,
    counted,
    openai_get,
    require_get,
    submitted,
    unrouted,
)
from telemetry.stats import DEPARTED_STATES

log = logging.getLogger(__name__)

OWNER = "sampling-service"
# A worker seen within this long is listed by /v1/models (stats.KNOWN_WORKERS_S keeps more).
MODEL_WORKERS_S = HEARTBEAT_TIMEOUT_MS / 1000


def _completions(
    request: HttpRequest, process: WebProcess, arrival: float, caller: Caller
) -> Handled:
    try:
        parsed = parse(schemas.CompletionRequest, read_body(request))
        found = route(process, parsed.model, sticky=sticky_of(caller, parsed.user))
        if isinstance(found, Unrouted):
            return unrouted(openai_failure, found)
        policy = found.served.watcher.current
        check_settings(parsed, policy)
        prompts = parsed.prompts()
        for index, prompt in enumerate(prompts):
            check_size(prompt, policy, "prompt" if len(prompts) == 1 else f"prompt.{index}")
        items = sample_requests(prompts, (), parsed)
    except Invalid as invalid:
        return Handled(RequestOutcome.BAD_REQUEST, openai_invalid(invalid))
    echoed = prompts if parsed.echo else None
    return _generate(request, found, caller, arrival, policy, items, parsed, echoed, chat=False)


def _chat_completions(
    request: HttpRequest, process: WebProcess, arrival: float, caller: Caller
) -> Handled:
    try:
        parsed = parse(schemas.ChatCompletionRequest, read_body(request))
        found = route(process, parsed.model, sticky=sticky_of(caller, parsed.user))
        if isinstance(found, Unrouted):
            return unrouted(openai_failure, found)
        policy = found.served.watcher.current
        check_settings(parsed, policy)
        chat = tuple((message.role, message.text()) for message in parsed.messages)
        check_size("".join(content for _, content in chat), policy, "messages")
        items = sample_requests(None, chat, parsed)
    except Invalid as invalid:
        return Handled(RequestOutcome.BAD_REQUEST, openai_invalid(invalid))
    return _generate(request, found, caller, arrival, policy, items, parsed, None, chat=True)


def _generate(
    request: HttpRequest,
    found: Route,
    caller: Caller,
    arrival: float,
    policy: Policy,
    items: list[SampleRequest],
    parsed: schemas._Settings,
    echoed: list[str] | None,
    *,
    chat: bool,
) -> Handled:
    """A validated request's items through its model's batches, and its answer (or error):
    the response names the model that served it (an alias's target)."""
    deadline = Deadline(arrival, policy.deadline_ms)
    if parsed.stream:
        return _stream(request, found, caller, items, parsed, echoed, deadline, chat=chat)
    sticky = sticky_of(caller, parsed.user)
    found, answers = submitted(found, caller, items, deadline, sticky)
    model = found.served
    if isinstance(answers, Failure):
        return Handled(answers.outcome, answer_failure(openai_failure, answers), model)
    texts = [answer.text for answer in answers]
    if echoed is not None:  # `echo`: each choice after its prompt
        texts = [echoed[index // parsed.n] + text for index, text in enumerate(texts)]
    tokens = charge(model.stats, caller, answers, found.entry.price, parsed.n)
    response = completion_response(model.name, parsed, answers, texts, tokens, chat=chat)
    return Handled(RequestOutcome.OK, _with_headers(response, answers.headers()), model)


def _stream(
    request: HttpRequest,
    found: Route,
    caller: Caller,
    items: list[SampleRequest],
    parsed: schemas._Settings,
    echoed: list[str] | None,
    deadline: Deadline,
    *,
    chat: bool,
) -> Handled:
    """A `stream`ing request: joined as any, then answered by events as its text comes."""
    model = found.served
    entered = enter(model, caller, items, deadline, stream=True, price=found.entry.price)
    if isinstance(entered, Failure):
        return Handled(entered.outcome, answer_failure(openai_failure, entered), model)
    ends = Ends.of(request, model, caller, found.entry.price, parsed.n)
    response, stream = completion_stream(
        model.name, ends, parsed, entered, echoed, deadline, chat=chat
    )
    return Handled(RequestOutcome.OK, response, model, stream)


def _with_headers(response: HttpResponse, headers: dict[str, str]) -> HttpResponse:
    for name, value in headers.items():
        response[name] = value
    return response


completions = counted(_completions, openai_failure)
chat_completions = counted(_chat_completions, openai_failure)


# --- models, the OpenAPI document, unknown paths -------------------------------------------


def _model_object(process: WebProcess, name: str, now: float) -> dict[str, Any] | None:
    """A model or alias as /v1/models lists it, with its live workers and what they serve
    (their heartbeats); None for a name the catalog does not have."""
    catalog = process.catalog.current
    alias = catalog.aliases.get(name)
    entry = catalog.models.get(name)
    if alias is not None:
        targets = [t.model for t in alias.targets if t.weight > 0]
        workers = sum(_live_workers(process, target, now)[0] for target in targets)
        return {"id": name, "object": "model", "created": alias.created or int(now),
                "owned_by": OWNER, "kind": "alias", "targets": targets,
                "workers": workers}  # fmt: skip
    if entry is None:
        return None
    workers, samplers = _live_workers(process, name, now)
    return {"id": name, "object": "model", "created": entry.created or int(now),
            "owned_by": OWNER, "kind": entry.kind, "description": entry.description,
            "root": ",".join(sorted(samplers)), "workers": workers}  # fmt: skip


def _live_workers(process: WebProcess, name: str, now: float) -> tuple[int, set[str]]:
    """A model's live workers (their heartbeats) and the samplers they run."""
    samplers: set[str] = set()
    live = 0
    try:
        infos = process.model(name).workers.infos(now - MODEL_WORKERS_S - 1)
    except REDIS_FAULTS as exc:
        log.warning("cannot read the workers' heartbeats: %s", exc)
        infos = []
    for _, info in infos:
        heartbeat_at = info.get("heartbeat_at")
        if not isinstance(heartbeat_at, int | float) or now - heartbeat_at > MODEL_WORKERS_S:
            continue
        if info.get("state") in DEPARTED_STATES:
            continue
        live += 1
        samplers.add(str(info.get("sampler", "")))
    return live, samplers


@openai_get
def models(request: HttpRequest, caller: Caller) -> HttpResponse:
    """Every model and alias with a live worker (an alias: one of its weighted targets)."""
    process, now = web_process(), time.time()
    listed = [_model_object(process, name, now) for name in process.catalog.current.names()]
    data = [found for found in listed if found is not None and found["workers"]]
    return json_response(200, {"object": "list", "data": data})


@openai_get
def model(request: HttpRequest, caller: Caller, model_id: str) -> HttpResponse:
    """A model or alias of the catalog, live or not (its `workers` says)."""
    found = _model_object(web_process(), model_id, time.time())
    if found is None:
        raise Invalid(f"the model {model_id!r} does not exist", "model", status=404,
                      code="model_not_found")  # fmt: skip
    return json_response(200, found)


@csrf_exempt
def not_found(request: HttpRequest) -> HttpResponse:
    return openai_error(
        404, f"no such endpoint: {request.path}", "not_found_error", None, "unknown_url"
    )


@csrf_exempt  # a POST gets a 405, not the CSRF page
def openapi(request: HttpRequest) -> HttpResponse:
    try:
        require_get(request)
    except Invalid as invalid:
        return openai_invalid(invalid)
    return HttpResponse(_openapi_json(), content_type=JSON)


@cache
def _openapi_json() -> str:
    return json.dumps(openapi_document())


# --- /api/inference ------------------------------------------------------------------------


def _inference(
    request: HttpRequest, process: WebProcess, arrival: float, caller: Caller
) -> Handled:
    request_id = uuid.uuid4().hex
    try:
        found = route(process, request.GET.get("model"), sticky=sticky_of(caller, None))
        if isinstance(found, Unrouted):
            handled = unrouted(inference_failure, found)
            handled.response["X-Request-ID"] = request_id
            return handled
        model = found.served
        policy = model.watcher.current
        parsed = parse(schemas.InferenceRequest, read_body(request))
        check_size(parsed.input, policy, "input")
    except Invalid as invalid:
        return Handled(RequestOutcome.BAD_REQUEST, inference_invalid(invalid))
    deadline = Deadline(arrival, policy.deadline_ms)
    answers = submit(model, caller, [parsed.input], deadline, price=found.entry.price)
    if isinstance(answers, Failure):
        return Handled(answers.outcome, _inference_failure(answers, request_id), model)
    charge(model.stats, caller, answers, found.entry.price)
    latency_ms = round((time.monotonic() - arrival) * 1000, 2)
    output = {"output": answers[0].text, "request_id": request_id, "latency_ms": latency_ms}
    response = json_response(200, output, {"X-Request-ID": request_id, **answers.headers()})
    return Handled(RequestOutcome.OK, response, model)


def _inference_failure(failure: Failure, request_id: str) -> HttpResponse:
    response = answer_failure(inference_failure, failure)
    response["X-Request-ID"] = request_id
    return response


inference = counted(_inference, inference_failure)
