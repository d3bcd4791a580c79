"""Why a request got no completion: one table, one row per problem, read by every endpoint.

A row says everything a problem means at once: its HTTP status, the request outcome it is
counted as (the `outcome` label of `sampling_requests_total`), OpenAI's error type and code
for /v1, the error name of /api/inference, whether the answer carries Retry-After, and the
item outcome (a worker's answer, batching.outcomes.ItemOutcome) that stands for it. Adding a
problem is adding a row here; each endpoint words a `Failure` from its row.

Django-free: the request path, the operators' app and the workers read it alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from batching.outcomes import ItemOutcome, RequestOutcome


@dataclass(frozen=True)
class ProblemRow:
    status: int  # the HTTP status
    outcome: RequestOutcome  # what the request is counted as
    retry_after: bool  # the answer says when to try again (Retry-After, retry_after_ms)
    item: ItemOutcome | None  # the worker's answer for one item that means this problem
    openai_type: str  # /v1's error.type
    openai_code: str  # /v1's error.code
    inference_error: str  # /api/inference's "error"


class Problem(ProblemRow, Enum):
    # fmt: off
    # name         = (status, request outcome, Retry-After, the worker's item outcome,
    #                  OpenAI error type, OpenAI error code, /api/inference error)
    OVERLOADED      = (503, RequestOutcome.REJECTED, True, None,
                       "overloaded_error", "overloaded", "SERVICE_OVERLOADED")
    UNAVAILABLE     = (503, RequestOutcome.ERROR, True, ItemOutcome.NOT_DISPATCHED,
                       "service_unavailable_error", "queue_unavailable", "SERVICE_UNAVAILABLE")
    DEADLINE        = (504, RequestOutcome.TIMEOUT, False, ItemOutcome.EXPIRED,
                       "timeout_error", "deadline_exceeded", "DEADLINE_EXCEEDED")
    PROMPT_REJECTED = (400, RequestOutcome.BAD_REQUEST, False, ItemOutcome.PROMPT_REJECTED,
                       "invalid_request_error", "prompt_rejected", "INVALID_REQUEST")
    SAMPLER_FAILED  = (502, RequestOutcome.ERROR, False, ItemOutcome.ERROR,
                       "server_error", "sampler_failed", "SAMPLER_FAILED")
    UNAUTHORIZED    = (401, RequestOutcome.UNAUTHORIZED, False, None,
                       "invalid_request_error", "invalid_api_key", "UNAUTHORIZED")
    RATE_LIMITED    = (429, RequestOutcome.RATE_LIMITED, True, None,
                       "rate_limit_error", "rate_limit_exceeded", "RATE_LIMITED")
    MODEL_UNAVAILABLE = (503, RequestOutcome.ERROR, True, None,
                       "service_unavailable_error", "model_unavailable", "MODEL_UNAVAILABLE")
    OVER_BUDGET     = (429, RequestOutcome.RATE_LIMITED, False, None,
                       "insufficient_quota", "insufficient_quota", "QUOTA_EXCEEDED")
    CLIENT_CLOSED   = (499, RequestOutcome.CANCELLED, False, ItemOutcome.CANCELLED,
                       "invalid_request_error", "client_closed_request", "CLIENT_CLOSED_REQUEST")
    # fmt: on

    @classmethod
    def of_item(cls, outcome: ItemOutcome) -> Problem | None:
        """The problem a worker's item outcome means; None for a completion (OK)."""
        return _BY_ITEM.get(outcome)


_BY_ITEM = {problem.item: problem for problem in Problem if problem.item is not None}


@dataclass(frozen=True)
class Failure:
    """A request's problem, with its one-line message for the client."""

    problem: Problem
    message: str
    retry_after_s: int = 1  # when to try again: said only where the problem's row says so

    @property
    def status(self) -> int:
        return self.problem.status

    @property
    def outcome(self) -> RequestOutcome:
        return self.problem.outcome

    def headers(self) -> dict[str, str]:
        """The HTTP headers the problem asks for, whatever the endpoint's wording."""
        headers = {}
        if self.problem.retry_after:
            headers["Retry-After"] = str(self.retry_after_s)
        if self.problem is Problem.UNAUTHORIZED:
            headers["WWW-Authenticate"] = 'Bearer realm="sampling"'
        return headers
