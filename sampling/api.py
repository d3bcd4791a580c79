"""The JSON API: OpenAI-compatible /v1 (completions, chat, models) and /api/inference.

Each request is validated (sampling.schemas) against the policy this process applies, its
prompts and choices become items of the batches (batching.generation.SampleRequest: one item
per prompt and choice, each with its own settings), and its answers come back through the
same path as /sample's (sampling.submission). Errors are JSON in each API's shape; nothing
here touches the database, and the request costs Redis what /sample costs per item.

Streaming (`stream: true`) answers in Server-Sent Events in OpenAI's chunk format: the batched
call returns whole completions, so each choice comes as one content chunk followed by its
finish chunk (and a usage chunk when `stream_options.include_usage`), then `data: [DONE]`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from functools import cache
from typing import Any, TypeVar

import redis
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from pydantic import BaseModel, ValidationError

from batching.access import Caller
from batching.generation import SEED_RANGE, SampleRequest
from batching.outcomes import RequestOutcome
from batching.policy import MAX_BATCH_SIZE, Policy
from batching.registry import HEARTBEAT_TIMEOUT_MS
from batching.stats import DEPARTED_STATES
from sampling import schemas
from sampling.openapi import openapi_document
from sampling.runtime import WebProcess, web_process
from sampling.submission import Failure, Problem, answer_failure, authenticate, counted, submit

log = logging.getLogger(__name__)

ModelT = TypeVar("ModelT", bound=BaseModel)

JSON = "application/json"
OWNER = "sampling-service"
# A worker seen within this long is listed by /v1/models (stats.KNOWN_WORKERS_S keeps more).
MODEL_WORKERS_S = HEARTBEAT_TIMEOUT_MS / 1000

# Problem -> (OpenAI error type, code).
OPENAI_ERRORS = {
    Problem.OVERLOADED: ("overloaded_error", "overloaded"),
    Problem.UNAVAILABLE: ("service_unavailable_error", "queue_unavailable"),
    Problem.DEADLINE: ("timeout_error", "deadline_exceeded"),
    Problem.PROMPT_REJECTED: ("invalid_request_error", "prompt_rejected"),
    Problem.SAMPLER_FAILED: ("server_error", "sampler_failed"),
    Problem.UNAUTHORIZED: ("invalid_request_error", "invalid_api_key"),
    Problem.RATE_LIMITED: ("rate_limit_error", "rate_limit_exceeded"),
}
# Problem -> /api/inference's error name.
INFERENCE_ERRORS = {
    Problem.OVERLOADED: "SERVICE_OVERLOADED",
    Problem.UNAVAILABLE: "SERVICE_UNAVAILABLE",
    Problem.DEADLINE: "DEADLINE_EXCEEDED",
    Problem.PROMPT_REJECTED: "INVALID_REQUEST",
    Problem.SAMPLER_FAILED: "SAMPLER_FAILED",
    Problem.UNAUTHORIZED: "UNAUTHORIZED",
    Problem.RATE_LIMITED: "RATE_LIMITED",
}


class Invalid(Exception):
    """A request refused before it reaches a batch: its status, message and the field."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        *,
        status: int = 400,
        code: str = "invalid_value",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code
        self.headers = headers or {}


def json_response(status: int, data: Any, headers: dict[str, str] | None = None) -> HttpResponse:
    body = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    response = HttpResponse(body, status=status, content_type=JSON)
    for name, value in (headers or {}).items():
        response[name] = value
    return response


def openai_error(
    status: int, message: str, error_type: str, param: str | None, code: str | None,
    headers: dict[str, str] | None = None,
) -> HttpResponse:  # fmt: skip
    error = {"message": message, "type": error_type, "param": param, "code": code}
    return json_response(status, {"error": error}, headers)


def openai_failure(failure: Failure) -> HttpResponse:
    error_type, code = OPENAI_ERRORS[failure.problem]
    return openai_error(failure.status, failure.message, error_type, None, code)


def openai_invalid(invalid: Invalid) -> HttpResponse:
    error_type = "not_found_error" if invalid.status == 404 else "invalid_request_error"
    return openai_error(
        invalid.status, invalid.message, error_type, invalid.param, invalid.code, invalid.headers
    )


# --- reading a request ---------------------------------------------------------------------


def _body(request: HttpRequest) -> bytes:
    """A POST's body, within Django's size limit, not empty."""
    if request.method != "POST":
        raise Invalid(f"use POST on {request.path}", status=405, code="method_not_allowed",
                      headers={"Allow": "POST"})  # fmt: skip
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    declared = request.META.get("CONTENT_LENGTH") or "0"
    if declared.isdigit() and int(declared) > limit:
        raise Invalid(f"request body is over the {limit}-byte limit", code="body_too_large")
    body = request.body
    if not body:
        raise Invalid("empty request body: send a JSON object", code="invalid_json")
    return body


def _parse(model: type[ModelT], body: bytes) -> ModelT:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=False)
        error = errors[0]
        location = _location(error["loc"])
        param = ".".join(location) or None
        if error["type"] == "json_invalid":
            message = f"the body is not valid JSON: {error['msg']}"
            raise Invalid(message, code="invalid_json") from None
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            message = "unknown field, not served by this API"
        elif any(_token_ids(other) for other in errors):
            message = "prompts as token ids are not supported: send text"
        raise Invalid(f"{param}: {message}" if param else message, param) from None


# pydantic names the member of a union that refused a value in the error's location
# ("constrained-str", "list[str]"...): not a field, so not what a client's `param` names.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _location(loc: tuple[int | str, ...]) -> list[str]:
    return [
        str(part)
        for part in loc
        if isinstance(part, int) or (part.isidentifier() and part not in _TYPE_TAGS)
    ]


def _token_ids(error: Any) -> bool:
    return error["loc"][:1] == ("prompt",) and isinstance(error.get("input"), int)


def _check_model(requested: str | None, process: WebProcess) -> str:
    served = process.aggregator.queue
    if requested is not None and requested != served:
        raise Invalid(
            f"the model {requested!r} does not exist: this server serves {served!r}",
            "model",
            status=404,
            code="model_not_found",
        )
    return served


def _check_settings(request: schemas._Settings, policy: Policy) -> None:
    for param, reason in request.unsupported():
        raise Invalid(reason, param, code="unsupported_parameter")
    limit = request.limit()
    if limit is not None and limit > policy.max_new_tokens:
        raise Invalid(
            f"max_tokens must be at most {policy.max_new_tokens} (the policy's max new tokens), "
            f"got {limit}",
            "max_tokens",
        )


def _check_size(text: str, policy: Policy, param: str) -> None:
    size = len(text.encode("utf-8"))
    if size > policy.max_prompt_bytes:
        raise Invalid(
            f"{param} is {size} bytes, over the {policy.max_prompt_bytes}-byte limit "
            "(max prompt bytes of the policy)",
            param,
        )


def _seed(seed: int | None, choice: int) -> int | None:
    """Choice i of a seeded request draws with seed + i (wrapped into the seed's range)."""
    if seed is None or choice == 0:
        return seed
    low, high = SEED_RANGE
    return (seed + choice - low) % (high - low + 1) + low


def _requests(
    prompts: list[str] | None,
    chat: tuple[tuple[str, str], ...],
    request: schemas._Settings,
) -> list[SampleRequest]:
    """One item per prompt and choice, prompt-major (choice index = prompt * n + choice)."""
    if (len(prompts) if prompts is not None else 1) * request.n > MAX_BATCH_SIZE:
        raise Invalid(
            f"n times the number of prompts must be at most {MAX_BATCH_SIZE}, got "
            f"{request.n} x {len(prompts or [chat])}",
            "n",
        )
    stops = request.stops()
    return [
        SampleRequest(
            prompt=prompt,
            messages=chat,
            max_tokens=request.limit(),
            temperature=request.temperature,
            top_p=request.top_p,
            stop=stops,
            seed=_seed(request.seed, choice),
        )
        for prompt in (prompts if prompts is not None else [""])
        for choice in range(request.n)
    ]


# --- the endpoints -------------------------------------------------------------------------


def _completions(
    request: HttpRequest, process: WebProcess, arrival: float, caller: Caller
) -> tuple[RequestOutcome, HttpResponse]:
    policy = process.watcher.current
    try:
        parsed = _parse(schemas.CompletionRequest, _body(request))
        model = _check_model(parsed.model, process)
        _check_settings(parsed, policy)
        prompts = parsed.prompts()
        for index, prompt in enumerate(prompts):
            _check_size(prompt, policy, "prompt" if len(prompts) == 1 else f"prompt.{index}")
        items = _requests(prompts, (), parsed)
    except Invalid as invalid:
        return RequestOutcome.BAD_REQUEST, openai_invalid(invalid)
    echoed = prompts if parsed.echo else None
    return _generate(process, caller, arrival, policy, items, model, parsed, echoed, chat=False)


def _chat_completions(
    request: HttpRequest, process: WebProcess, arrival: float, caller: Caller
) -> tuple[RequestOutcome, HttpResponse]:
    policy = process.watcher.current
    try:
        parsed = _parse(schemas.ChatCompletionRequest, _body(request))
        model = _check_model(parsed.model, process)
        _check_settings(parsed, policy)
        chat = tuple((message.role, message.text()) for message in parsed.messages)
        _check_size("".join(content for _, content in chat), policy, "messages")
        items = _requests(None, chat, parsed)
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
    texts = [answer[1] for answer in answers]
    if echoed is not None:  # `echo`: each choice after its prompt
        texts = [echoed[index // parsed.n] + text for index, text in enumerate(texts)]
    return RequestOutcome.OK, answers.cache_header(
        _answer(model, parsed, answers, texts, chat=chat)
    )


def _finish_reason(answer: list[Any]) -> str:
    # A worker of the version before the API answers [outcome, text]: count such an answer as
    # ended by the model, with no tokens (upgrade the workers before the web processes).
    return str(answer[2]) if len(answer) > 2 else "stop"


def _tokens(answer: list[Any], index: int) -> int:
    return int(answer[index]) if len(answer) > index else 0


def _usage(answers: list[list[Any]], n: int) -> dict[str, int]:
    """Prompt tokens once per prompt (its first choice's count), completion tokens of all."""
    prompt_tokens = sum(_tokens(answer, 3) for answer in answers[::n])
    completion_tokens = sum(_tokens(answer, 4) for answer in answers)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _answer(
    model: str,
    parsed: schemas._Settings,
    answers: list[list[Any]],
    texts: list[str],
    *,
    chat: bool,
) -> HttpResponse:
    prefix, kind = ("chatcmpl", "chat.completion") if chat else ("cmpl", "text_completion")
    head = {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
            "model": model}  # fmt: skip
    usage = _usage(answers, parsed.n)
    if parsed.stream:
        include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
        return _stream(head, answers, texts, usage if include_usage else None, chat=chat)
    if chat:
        choices: list[dict[str, Any]] = [
            {"index": index, "message": {"role": "assistant", "content": text},
             "finish_reason": _finish_reason(answer), "logprobs": None}
            for index, (answer, text) in enumerate(zip(answers, texts, strict=True))
        ]  # fmt: skip
    else:
        choices = [
            {
                "text": text,
                "index": index,
                "finish_reason": _finish_reason(answer),
                "logprobs": None,
            }
            for index, (answer, text) in enumerate(zip(answers, texts, strict=True))
        ]
    return json_response(200, {**head, "choices": choices, "usage": usage})


def _stream(
    head: dict[str, Any],
    answers: list[list[Any]],
    texts: list[str],
    usage: dict[str, int] | None,
    *,
    chat: bool,
) -> HttpResponse:
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    events = []
    for index, (answer, text) in enumerate(zip(answers, texts, strict=True)):
        if chat:
            content = {"index": index, "delta": {"role": "assistant", "content": text},
                       "finish_reason": None, "logprobs": None}  # fmt: skip
            finish = {
                "index": index,
                "delta": {},
                "finish_reason": _finish_reason(answer),
                "logprobs": None,
            }
        else:
            content = {"text": text, "index": index, "finish_reason": None, "logprobs": None}
            finish = {
                "text": "",
                "index": index,
                "finish_reason": _finish_reason(answer),
                "logprobs": None,
            }
        events.append({**head, "choices": [content]})
        events.append({**head, "choices": [finish]})
    if usage is not None:
        events.append({**head, "choices": [], "usage": usage})
    body = "".join(
        f"data: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"
        for event in events
    )
    response = HttpResponse(body + "data: [DONE]\n\n", content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # a proxy passes the events on as they come
    return response


completions = counted(_completions, openai_failure)
chat_completions = counted(_chat_completions, openai_failure)


def _live_models(process: WebProcess) -> dict[str, Any]:
    """The served model: the queue, with what its live workers serve (their heartbeats)."""
    now = time.time()
    samplers: set[str] = set()
    live = 0
    try:
        infos = process.aggregator.workers.infos(now - MODEL_WORKERS_S - 1)
    except redis.RedisError as exc:
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


@csrf_exempt  # a POST gets a 405, not the CSRF page
def models(request: HttpRequest) -> HttpResponse:
    process = web_process()
    try:
        body_free(request)
    except Invalid as invalid:
        return openai_invalid(invalid)
    caller = authenticate(request, process)
    if isinstance(caller, Failure):
        return answer_failure(openai_failure, caller)
    return json_response(200, {"object": "list", "data": [_live_models(process)]})


@csrf_exempt
def model(request: HttpRequest, model_id: str) -> HttpResponse:
    process = web_process()
    try:
        body_free(request)
    except Invalid as invalid:
        return openai_invalid(invalid)
    caller = authenticate(request, process)
    if isinstance(caller, Failure):
        return answer_failure(openai_failure, caller)
    try:
        _check_model(model_id, process)
    except Invalid as invalid:
        return openai_invalid(invalid)
    return json_response(200, _live_models(process))


@csrf_exempt
def not_found(request: HttpRequest) -> HttpResponse:
    return openai_error(
        404, f"no such endpoint: {request.path}", "not_found_error", None, "unknown_url"
    )


def body_free(request: HttpRequest) -> None:
    if request.method not in ("GET", "HEAD"):
        raise Invalid(f"use GET on {request.path}", status=405, code="method_not_allowed",
                      headers={"Allow": "GET, HEAD"})  # fmt: skip


@csrf_exempt
def openapi(request: HttpRequest) -> HttpResponse:
    try:
        body_free(request)
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
        parsed = _parse(schemas.InferenceRequest, _body(request))
        _check_size(parsed.input, policy, "input")
    except Invalid as invalid:
        if invalid.status == 405:
            return RequestOutcome.BAD_REQUEST, openai_invalid(invalid)
        error = {"error": "INVALID_REQUEST", "message": invalid.message}
        return RequestOutcome.BAD_REQUEST, json_response(400, error)
    answers = submit(process, caller, [parsed.input], arrival + policy.deadline_ms / 1000,
                     policy.deadline_ms)  # fmt: skip
    if isinstance(answers, Failure):
        response = answer_failure(_inference_failure, answers)
        response["X-Request-ID"] = request_id
        return answers.outcome, response
    latency_ms = round((time.monotonic() - arrival) * 1000, 2)
    output = {"output": answers[0][1], "request_id": request_id, "latency_ms": latency_ms}
    response = json_response(200, output, {"X-Request-ID": request_id})
    return RequestOutcome.OK, answers.cache_header(response)


def _inference_failure(failure: Failure) -> HttpResponse:
    body: dict[str, Any] = {"error": INFERENCE_ERRORS[failure.problem], "message": failure.message}
    if failure.retry_after_s:
        body["retry_after_ms"] = failure.retry_after_s * 1000
    return json_response(failure.status, body)


inference = counted(_inference, _inference_failure)
