"""A batch's turn on a worker's GPU (workers.runner): what its seal took, its answers, and
the record and statistics it leaves."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from batching.answers import Answer, WireAnswer, to_wire
from batching.backfill import BackfillItem
from batching.generation import Completion
from batching.items import Item, SealedBatch
from batching.outcomes import ItemOutcome
from batching.policy import Policy
from telemetry import stats
from workers.samplers.base import PromptRejected, RowFailed

# One item's answer as it leaves the worker (batching.answers: the wire format).
Result = WireAnswer


# A worker sends its items' queue times to the statistics with a heartbeat this often: a
# second's items span a few dozen histogram buckets, a HINCRBY each and per granularity,
# which every second would add a few percent to Redis's commands per request.
QUEUE_TIMES_EVERY_S = 10.0

# Items whose call never took them: they waited no queue time.
_NOT_CALLED = (ItemOutcome.EXPIRED, ItemOutcome.CANCELLED)


def answer_of(item: Item, completion: Completion | PromptRejected) -> Answer:
    if isinstance(completion, RowFailed):
        return Answer(ItemOutcome.ERROR, str(completion) or "the sampler failed for this prompt")
    if isinstance(completion, PromptRejected):
        return Answer(ItemOutcome.PROMPT_REJECTED, str(completion) or "prompt rejected")
    if item.request is None and not item.key_id:  # an anonymous /sample answer: the text alone
        return Answer(ItemOutcome.OK, completion.text)
    # An API answer, or a keyed /sample one: with its tokens (what its key is charged for).
    return Answer(
        ItemOutcome.OK,
        completion.text,
        str(completion.finish_reason),
        completion.prompt_tokens,
        completion.completion_tokens,
    )


@dataclass
class Turn:
    """One batch's turn on the GPU: sealed (`begin`), sampled (`sample`), then reported."""

    batch_id: str
    sealed: SealedBatch
    policy: Policy
    results: dict[int, Answer]  # by item index; every index once sampled
    chunks: list[list[int]]  # the live items' indexes, one list per sampler call
    began: float  # perf_counter when the seal started
    called: float = 0.0  # perf_counter when its first sampler call started (0: none)
    sampler_ms: float = 0.0
    ended: float = 0.0  # perf_counter when the last call returned
    # API key id (0: anonymous) -> (prompt tokens, completion tokens) of its items sampled:
    # the queue's sampled tokens (statistics), and the completion tokens charged to the keys'
    # token rate windows, when the turn is reported. A key's usage (billing) is what its 200
    # answers delivered, counted by the web processes (telemetry/stats.py).
    tokens_by_key: dict[int, tuple[int, int]] = field(default_factory=dict)
    # The policy as the sampler ran it (its generation settings, should it have refused the
    # policy's): the response cache stores the turn's answers under its digest.
    ran: Policy | None = None
    # Backfill items the seal took into its places (batching.backfill), after the batch's own:
    # item index len(sealed.items) + k is backfill[k].
    backfill: list[BackfillItem] = field(default_factory=list)
    # Their raw strings as the seal took them, and those the seal took that the call leaves
    # out (they go back to the lane when the turn is reported).
    backfill_taken: list[bytes] = field(default_factory=list)
    backfill_returned: list[bytes] = field(default_factory=list)
    calls_ms: list[float] = field(default_factory=list)  # each sampler call's, in order
    # Its calls as predicted at the seal (workers.pipeline: when the GPU frees), and the part
    # of their measured time its top-up's items took, as predicted (left out of what the
    # worker learns of the queue's calls).
    predicted_ms: float = 0.0
    backfill_extra_ms: float = 0.0

    @property
    def items(self) -> list[Item]:
        """The batch's items, then its backfill items as rows are made of them."""
        return self.sealed.items + [item.as_item() for item in self.backfill]

    @property
    def backfill_answers(self) -> list[Answer]:
        first = len(self.sealed.items)
        return [self.results[first + k] for k in range(len(self.backfill))]

    @property
    def in_order(self) -> list[Answer]:
        return [self.results[index] for index in range(len(self.sealed.items))]

    @property
    def answers(self) -> list[Result]:
        """Every item's answer, in order, as they leave the worker."""
        return to_wire(self.in_order)

    def answers_failing_the_rest(self, reason: str) -> list[Result]:
        """Every item's answer, an error for the items not answered yet (a call cut off)."""
        failed = Answer(ItemOutcome.ERROR, reason)
        return to_wire(self.results.get(index, failed) for index in range(len(self.sealed.items)))

    @property
    def interactive(self) -> bool:
        """Whether it sealed a batch of requests (else only backfill items: no answers to
        publish)."""
        return bool(self.sealed.batch_id)

    def call_started_ms(self) -> int | None:
        """When its first call started, by the Redis node's clock as the seal's time is."""
        if not self.called:
            return None
        return self.sealed.now_ms + round((self.called - self.began) * 1000)

    def queue_times_ms(self, call_started_ms: int | None) -> list[float]:
        """Each called item's queue time: from its request's arrival (its expiry less the
        deadline it carries) to its call's start, both by the Redis node's clock. A turn of
        several calls counts from its first."""
        if call_started_ms is None:
            return []
        policy_ms = self.policy.deadline_ms  # for an older web process's items only
        return [
            max(0.0, call_started_ms - item.arrived_at_ms(policy_ms))
            for item, answer in zip(self.sealed.items, self.in_order, strict=True)
            if answer.outcome not in _NOT_CALLED
        ]


def record_of(turn: Turn, worker: str) -> dict[str, Any]:
    """The turn's batch record (batch_log: the stats page, tests, benchmarks)."""
    sealed, policy, results = turn.sealed, turn.policy, turn.in_order
    counts = Counter(answer.outcome for answer in results)
    expired = counts[ItemOutcome.EXPIRED]
    queue_wait_ms = sealed.now_ms - sealed.opened_at_ms if sealed.opened_at_ms >= 0 else None
    return {
        "batch_id": turn.batch_id,
        "lane": sealed.lane,
        "worker": worker,
        "size": len(results),
        "sampled": len(results) - expired - counts[ItemOutcome.CANCELLED],
        **{str(outcome): counts[outcome] for outcome in ItemOutcome},
        "queue_wait_ms": queue_wait_ms,
        "sampler_ms": round(turn.sampler_ms, 2),
        "sealed_at_ms": sealed.now_ms,
        # When its call started, by the Redis node's clock as the seal's time is: what a
        # stream's time to first token counts from.
        "call_started_ms": turn.call_started_ms(),
        "policy_version": policy.version,
        "max_batch_size": policy.max_batch_size,
        "backfill": len(turn.backfill),
    }


def statistics_of(turn: Turn, record: dict[str, Any]) -> dict[str, int]:
    """The turn's counts for the statistics, from its record (`record_of`). A turn of backfill
    items only is no batch of the queue's (its fill, its mean size): its call counts as busy
    time and backfill."""
    worker = record["worker"]
    if turn.interactive:
        counts = stats.batch_counts(
            worker=worker,
            size=record["size"],
            expired=record["expired"],
            queue_wait_ms=record["queue_wait_ms"],
            sampler_ms=turn.sampler_ms,
            calls=len(turn.chunks),
            max_batch_size=turn.policy.max_batch_size,
        )
    else:
        counts = stats.busy_counts(worker, turn.sampler_ms)
    counts[stats.BACKFILL_ITEMS] = len(turn.backfill)
    counts[stats.SAMPLED_PROMPT_TOKENS] = sum(p for p, _ in turn.tokens_by_key.values())
    counts[stats.SAMPLED_COMPLETION_TOKENS] = sum(c for _, c in turn.tokens_by_key.values())
    return counts
