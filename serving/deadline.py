"""A request's deadline as its web process holds it: one value from arrival to answer.

The policy's deadline counts from the request's arrival at the node (serving.shedding reads
it). The batch protocol gets two numbers of it: what is left, and the whole. An item carries
the time it expires, by the Redis node's clock, and the whole deadline: a worker computes the
item's queue time from the two (batching.items), without the worker's own policy, which may
have changed while the item waited."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Deadline:
    """When the request arrived (monotonic s) and its deadline (ms): the policy's when it
    arrived, which a later change of the policy does not move."""

    arrival: float
    deadline_ms: int

    @property
    def expires(self) -> float:
        """When it expires (monotonic s)."""
        return self.arrival + self.deadline_ms / 1000

    def remaining_s(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self.expires - time.monotonic())

    def remaining_ms(self) -> int:
        """Milliseconds left: negative once passed (admission refuses such a request)."""
        return int((self.expires - time.monotonic()) * 1000)

    def passed(self) -> bool:
        return time.monotonic() >= self.expires
