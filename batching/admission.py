"""Admission control: refuse at once a request whose batch cannot finish by its deadline.

When batches are queued behind every live worker (a backlog), a batch joined now waits for
the batches ahead of it, shared among the workers, for a running call to end, then takes its
own turn. With `ahead` batches ahead of `workers` workers, it is the `ahead % workers`-th to
take a GPU that frees, in round `ahead // workers`:

    free + (ahead // workers + 1) x one batch's turn on a GPU

where `free` is when that GPU frees: the worst case, one whole turn (the call may have just
started), unless the shard knows when its running calls end (each seal records its call's
predicted end): then that end, plus ADMISSION_MARGIN_TURNS of a turn (at most
ADMISSION_MARGIN_MAX_MS), never more than a turn.
A request whose remaining budget is shorter gets a 503 with Retry-After instead of a 504
later. An optimistic `+ 1` turn, without the running calls' ends, let in requests that then
expired in the queue: under overload the benchmark lost about a quarter of its goodput that
way. Without a backlog, without a live worker or without a measured turn, a request is always
taken: a worker drops it later if its deadline cannot be met, and without workers it waits
for its deadline.

The formula lives here once: the per-batch scripts share its Lua twin (`predicted_ms` in
batching/lua/common.lua, with the constants substituted from here); the capacity planner's
simulation (planning.simulation) calls `refuses`; a contract test feeds both the same inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# The running call (which may have just started) and the batch's own call: the worst case.
WORST_CASE_EXTRA_TURNS = 2
# A running call whose end is known is counted to end this share of a turn later, at most
# ADMISSION_MARGIN_MAX_MS: the web path and the gap between calls, and a call that runs past
# its prediction. The first two do not grow with the call, so a long call's margin is capped.
ADMISSION_MARGIN_TURNS = 0.2
ADMISSION_MARGIN_MAX_MS = 20.0


def predicted_ms(
    ahead: int, workers: int, turn_ms: float, frees: Sequence[float] = ()
) -> float | None:
    """When a batch joined now would finish, in ms from now; None without a backlog (fewer
    batches ahead than live workers), a live worker or a measured turn. `frees`: in how many
    ms each running call ends, soonest first, as far as the shard knows them (a GPU not in it
    frees one turn from now, the worst case)."""
    if workers <= 0 or turn_ms <= 0 or ahead < workers:
        return None
    rounds, slot = divmod(ahead, workers)
    free = turn_ms
    if slot < len(frees):
        free = min(turn_ms, max(0.0, frees[slot]) + margin_ms(turn_ms))
    return free + (rounds + WORST_CASE_EXTRA_TURNS - 1) * turn_ms


def margin_ms(turn_ms: float) -> float:
    """What a known running call's end is counted late by."""
    return min(ADMISSION_MARGIN_TURNS * turn_ms, ADMISSION_MARGIN_MAX_MS)


def refuses(
    ahead: int, workers: int, turn_ms: float, budget_ms: float, frees: Sequence[float] = ()
) -> bool:
    predicted = predicted_ms(ahead, workers, turn_ms, frees)
    return predicted is not None and predicted > budget_ms


@dataclass(frozen=True)
class AdmissionInputs:
    """What a worker knows that admission needs, passed with every seal and heartbeat."""

    workers: int
    turn_ms: float
