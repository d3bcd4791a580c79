"""The JSON API's endpoints: OpenAI-compatible /v1 (completions, chat, models, the OpenAPI
document) and /api/inference.

Each request is read and checked against the policy this process applies
(sampling.validation), its prompts and choices become items of the batches (one
batching.generation.SampleRequest per prompt and choice, each with its own settings), and its
answers come back through the same path as /sample's (sampling.submission), shaped as OpenAI's
(sampling.completions). Errors are JSON in each API's shape (sampling.responses); nothing here
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

from batching.access import Caller
from batching.generation import SampleRequest
from batching.outcomes import RequestOutcome
from batching.policy import Policy
from batching.problems import Failure
from batching.registry import HEARTBEAT_TIMEOUT_MS
from batching.stats import DEPARTED_STATES
from batching.topology import REDIS_FAULTS
from sampling import schemas
from sampling.completions import completion_response
from sampling.openapi import openapi_document
from sampling.responses import (
    JSON,
    Invalid,
    inference_failure,
    inference_invalid,
    json_response,
    openai_error,
    openai_failure,
    openai_invalid,
)
from sampling.runtime import WebProcess, web_process
from sampling.submission import charge, submit
from sampling.validation import (
    check_model,
    check_settings,
    check_size,
    parse,
    read_body,
    sample_requests,
)
from sampling.wrappers import answer_failure, counted, openai_get, require_get

log = logging.getLogger(__name__)

OWNER = "sampling-service"
# A worker seen within this long is listed by /v1/models (stats.KNOWN_WORKERS_S keeps more).
MODEL_WORKERS_S = HEARTBEAT_TIMEOUT_MS / 1000


def _completions(
    request: HttpRequest, process: WebProcess, arrival: float, caller: Caller
) -> tuple[RequestOutcome, HttpResponse]:
    policy = process.watcher.current
    try:
        parsed = parse(schemas.CompletionRequest, read_body(request))
        model = check_model(parsed.model, process)
        check_settings(parsed, policy)
        prompts = parsed.prompts()
        for index, prompt in enumerate(prompts):
            check_size(prompt, policy, "prompt" if len(prompts) == 1 else f"prompt.{index}")
        items = sample_requests(prompts, (), parsed)
    except Invalid as invalid:
        return RequestOutcome.BAD_REQUEST, openai_invalid(invalid)
    echoed = prompts if parsed.echo else None
    return _generate(process, caller, arrival, policy, items, model, parsed, echoed, chat=False)


def _chat_completions(
    request: HttpRequest, process: WebProcess, arrival: float, caller: Caller
) -> tuple[RequestOutcome, HttpResponse]:
    policy = process.watcher.current
    try:
        parsed = parse(schemas.ChatCompletionRequest, read_body(request))
        model = check_model(parsed.model, process)
        check_settings(parsed, policy)
        chat = tuple((message.role, message.text()) for message in parsed.messages)
        check_size("".join(content for _, content in chat), policy, "messages")
        items = sample_requests(None, chat, parsed)
    except Invalid as invalid:
        return RequestOutcome.BAD_REQUEST, openai_invalid(invalid)
    return _generate(process, caller, arrival, policy, items, model, parsed, None, chat=True)


def _generate(
    process: WebProcess,
    caller: Caller,
    arrival: float,
    policy: Policy,
    items: list[SampleRequest],
    model: str,
    parsed: schemas._Settings,
    echoed: list[str] | None,
    *,
    chat: bool,
) -> tuple[RequestOutcome, HttpResponse]:
    """A validated request's items through the batches, and its answer (or error)."""
    answers = submit(
        process, caller, items, arrival + policy.deadline_ms / 1000, policy.deadline_ms
    )
    if isinstance(answers, Failure):
        return answers.outcome, answer_failure(openai_failure, answers)
    texts = [answer.text for answer in answers]
    if echoed is not None:  # `echo`: each choice after its prompt
        texts = [echoed[index // parsed.n] + text for index, text in enumerate(texts)]
    tokens = charge(process.stats, caller, answers, parsed.n)
    response = completion_response(model, parsed, answers, texts, tokens, chat=chat)
    return RequestOutcome.OK, _with_headers(response, answers.headers())


def _with_headers(response: HttpResponse, headers: dict[str, str]) -> HttpResponse:
    for name, value in headers.items():
        response[name] = value
    return response


completions = counted(_completions, openai_failure)
chat_completions = counted(_chat_completions, openai_failure)


# --- models, the OpenAPI document, unknown paths -------------------------------------------


def _live_models(process: WebProcess) -> dict[str, Any]:
    """The served model: the queue, with what its live workers serve (their heartbeats)."""
    now = time.time()
    samplers: set[str] = set()
    live = 0
    try:
        infos = process.aggregator.workers.infos(now - MODEL_WORKERS_S - 1)
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
    return {"id": process.aggregator.queue, "object": "model", "created": int(now),
            "owned_by": OWNER, "root": ",".join(sorted(samplers)), "workers": live}  # fmt: skip


@openai_get
def models(request: HttpRequest, caller: Caller) -> HttpResponse:
    return json_response(200, {"object": "list", "data": [_live_models(web_process())]})


@openai_get
def model(request: HttpRequest, caller: Caller, model_id: str) -> HttpResponse:
    process = web_process()
    check_model(model_id, process)
    return json_response(200, _live_models(process))


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
) -> tuple[RequestOutcome, HttpResponse]:
    policy = process.watcher.current
    request_id = uuid.uuid4().hex
    try:
        parsed = parse(schemas.InferenceRequest, read_body(request))
        check_size(parsed.input, policy, "input")
    except Invalid as invalid:
        return RequestOutcome.BAD_REQUEST, inference_invalid(invalid)
    answers = submit(process, caller, [parsed.input], arrival + policy.deadline_ms / 1000,
                     policy.deadline_ms)  # fmt: skip
    if isinstance(answers, Failure):
        response = answer_failure(inference_failure, answers)
        response["X-Request-ID"] = request_id
        return answers.outcome, response
    charge(process.stats, caller, answers)
    latency_ms = round((time.monotonic() - arrival) * 1000, 2)
    output = {"output": answers[0].text, "request_id": request_id, "latency_ms": latency_ms}
    response = json_response(200, output, {"X-Request-ID": request_id, **answers.headers()})
    return RequestOutcome.OK, response


inference = counted(_inference, inference_failure)
