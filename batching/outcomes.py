"""One vocabulary of outcomes, for the views, statistics, metrics, simulation and benchmarks.

Two levels, two enums, no shared word:
- ItemOutcome: what the worker did with one item of a batch. A batch's result is a list
  aligned with its items, each entry [ItemOutcome, text].
- RequestOutcome: what a request (to /sample or the API) got. Its values are the `outcome` label of
  `sampling_requests_total` and the `req:<outcome>` statistics counters: they are stable.
"""

from __future__ import annotations

from enum import StrEnum


class ItemOutcome(StrEnum):
    OK = "ok"  # the completion is the text
    EXPIRED = "expired"  # dropped before sampling: one more call could not meet its deadline
    PROMPT_REJECTED = "prompt_rejected"  # the sampler refused this prompt alone (too long...)
    ERROR = "error"  # the sampler failed for the whole batch
    NOT_DISPATCHED = "not_dispatched"  # the batch's task could not be sent (broker down)
    CANCELLED = "cancelled"  # its streaming client left: dropped before its call, or cut in it


class RequestOutcome(StrEnum):
    OK = "ok"  # 200: a completion
    TIMEOUT = "timeout"  # 504: no completion within the deadline
    REJECTED = "rejected"  # 503 + Retry-After: turned away by admission control (overloaded)
    BAD_REQUEST = "bad_request"  # 4xx: the request or its prompt was refused
    UNAUTHORIZED = "unauthorized"  # 401: no valid API key (missing, unknown, revoked, expired)
    RATE_LIMITED = "rate_limited"  # 429 + Retry-After: the key is over its rate limit
    ERROR = "error"  # 502 (the sampler failed) or 503 (Redis or the broker unreachable)
    CANCELLED = "cancelled"  # a stream whose client left before its end
