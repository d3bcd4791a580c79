"""How the JSON endpoints word their answers and refusals: OpenAI's error JSON on /v1, the
seed design's on /api/inference (the plain-text /sample words its own, serving.views).

A refusal is either an `Invalid` (the request itself is wrong: a 4xx with the field at fault)
or a `Failure` (batching.problems: the service could not answer it); each endpoint words both
from the same table.
"""

from __future__ import annotations

import json
from typing import Any

from django.http import HttpResponse

from batching.problems import Failure

JSON = "application/json"


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
    problem = failure.problem
    return openai_error(
        failure.status, failure.message, problem.openai_type, None, problem.openai_code
    )


def openai_invalid(invalid: Invalid) -> HttpResponse:
    error_type = "not_found_error" if invalid.status == 404 else "invalid_request_error"
    return openai_error(
        invalid.status, invalid.message, error_type, invalid.param, invalid.code, invalid.headers
    )


def inference_failure(failure: Failure) -> HttpResponse:
    """/api/inference's wording: `{"error": NAME, "message", "retry_after_ms"?}`."""
    body: dict[str, Any] = {"error": failure.problem.inference_error, "message": failure.message}
    if failure.problem.retry_after:
        body["retry_after_ms"] = failure.retry_after_s * 1000
    return json_response(failure.status, body)


def inference_invalid(invalid: Invalid) -> HttpResponse:
    if invalid.status == 405:  # the method: as every JSON endpoint says it
        return openai_invalid(invalid)
    return json_response(400, {"error": "INVALID_REQUEST", "message": invalid.message})
