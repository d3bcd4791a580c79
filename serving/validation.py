"""Reading a JSON request of the API: its body, its model (serving.schemas), its checks
against the policy this process applies, and its items (one SampleRequest per prompt and
choice). Every refusal is an `Invalid` (serving.responses) naming the field at fault.
"""

from __future__ import annotations

from typing import Any, TypeVar

from django.conf import settings
from django.http import HttpRequest
from pydantic import BaseModel, ValidationError

from batching.generation import SEED_RANGE, SampleRequest
from batching.policy import MAX_BATCH_SIZE, Policy
from serving import schemas
from serving.responses import Invalid

ModelT = TypeVar("ModelT", bound=BaseModel)


def read_body(request: HttpRequest) -> bytes:
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


def parse(model: type[ModelT], body: bytes) -> ModelT:
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
    return error["loc"][:1] in (("prompt",), ("input",)) and isinstance(error.get("input"), int)


def check_settings(request: schemas._Settings, policy: Policy) -> None:
    for param, reason in request.unsupported():
        raise Invalid(reason, param, code="unsupported_parameter")
    limit = request.limit()
    if limit is not None and limit > policy.max_new_tokens:
        raise Invalid(
            f"max_tokens must be at most {policy.max_new_tokens} (the policy's max new tokens), "
            f"got {limit}",
            "max_tokens",
        )


def check_size(text: str, policy: Policy, param: str) -> None:
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


def sample_requests(
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
