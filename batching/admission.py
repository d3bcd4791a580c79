"""Admission control: refuse at once a request whose batch cannot finish by its deadline.

When batches are queued behind every live worker (a backlog), a batch joined now waits for
the batches ahead of it, shared among the workers, for the calls running now (which may have
just started), then takes its own turn. The prediction is that worst case:

    (batches ahead // live workers + WORST_CASE_EXTRA_TURNS) x one batch's turn on a GPU

and a request whose remaining budget is shorter gets a 503 with Retry-After instead of a 504
later. An optimistic `+ 1` let in requests that then expired in the queue: under overload the
benchmark lost about a quarter of its goodput that way. Without a backlog, without a live
worker or without a measured turn, a request is always taken: a worker drops it later if its
deadline cannot be met, and without workers it waits for its deadline.

The formula lives here once: the per-batch scripts share its Lua twin (`predicted_ms` in
batching/lua/common.lua, with WORST_CASE_EXTRA_TURNS substituted from here); the capacity
planner's simulation (planning.simulation) calls `refuses`; a contract test feeds both the same
inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

# The running calls (which may have just started) and the batch's own call.
WORST_CASE_EXTRA_TURNS = 2


def predicted_ms(ahead: int, workers: int, turn_ms: float) -> float | None:
    """When a batch joined now would finish, in ms from now; None without a backlog (fewer
    batches ahead than live workers), a live worker or a measured turn."""
    if workers <= 0 or turn_ms <= 0 or ahead < workers:
        return None
    return (ahead // workers + WORST_CASE_EXTRA_TURNS) * turn_ms


def refuses(ahead: int, workers: int, turn_ms: float, budget_ms: float) -> bool:
    predicted = predicted_ms(ahead, workers, turn_ms)
    return predicted is not None and predicted > budget_ms


@dataclass(frozen=True)
class AdmissionInputs:
    """What a worker knows that admission needs, passed with every seal and heartbeat."""

    workers: int
    turn_ms: float
