"""A request's items through the batches: join, dispatch, wait. Shared by every endpoint.

A request's items join their shard's open batch with its one Redis round trip (a list prompt
or `n` choices are several items, each its own row of a batch, appended by one call); the
request that opened a batch sends its Celery task (by name, task id = batch id) and confirms
it; then the request waits on each batch's result through the process's shared result
listener, with what is left of its deadline. What the request gets is every item's answer, or
one `Failure` that each endpoint words in its own format (plain text on /sample, OpenAI's
error JSON on /v1, the seed design's JSON on /api/inference).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import redis
from celery.backends.redis import RedisBackend
from celery.exceptions import TimeoutError as CeleryTimeoutError

from accounts.access import Caller
from accounts.budgets import KEY_HELD, OWNER_HELD, Budgets, SpendHold, most_cost
from accounts.ratelimit import Limited, RateLimiter, Reservation
from batching import cache
from batching.aggregator import BatchAggregator
from batching.answers import Answer, to_wire
from batching.catalog import Price
from batching.generation import SampleRequest
from batching.items import Joined, Ticket
from batching.join import AppendCounter
from batching.outcomes import ItemOutcome
from batching.policy import PolicyWatcher
from batching.problems import Failure, Problem
from batching.protocol import RUN_BATCH_TASK, task_priority
from batching.result_store import queue_result
from batching.topology import REDIS_FAULTS
from serving import metrics
from serving.broker import app as celery_app
from serving.deadline import Deadline
from serving.shedding import JOINED_AT, QuickestAnswers
from telemetry.stats import RequestStats

log = logging.getLogger(__name__)

QUEUE_UNAVAILABLE = "batch queue unavailable"
# One quick reconnect (a pooled connection gone stale after a broker restart), no more: a
# broker that refuses twice is not back within a deadline. Celery's default retries for ~1 s.
PUBLISH_RETRY = {"max_retries": 1, "interval_start": 0, "interval_step": 0.05, "interval_max": 0.05}


class RequestPath(Protocol):
    """What a submission uses of its web process (serving.runtime.WebProcess)."""

    client: redis.Redis
    aggregator: BatchAggregator
    watcher: PolicyWatcher
    stats: RequestStats
    limiter: RateLimiter
    quickest: QuickestAnswers
    budgets: Budgets | None
    read_deadlines: bool


def unavailable(message: str = QUEUE_UNAVAILABLE) -> Failure:
    return Failure(Problem.UNAVAILABLE, message)


class Tokens(NamedTuple):
    """A 200 answer's usage, what its key is charged for (telemetry/stats.py): prompt tokens
    once per prompt, completion tokens of every choice, and of the prompt tokens, those of
    prompts answered from the response cache."""

    prompt: int
    completion: int
    cached: int


class Answers(list[Answer]):
    """A request's answers, one per item, and what the response cache did for it: "hit" (every
    item answered from it), "miss" (some item sampled), or "" (the cache not asked); and which
    items it answered (`from_cache`, by index)."""

    cache: str = ""
    from_cache: frozenset[int] = frozenset()
    reservation: Reservation | None = None  # its key's tokens held from admission
    hold: SpendHold | None = None  # its key's budget held from admission

    def settle(self, used: int | None, spent: int | None) -> None:
        """The request's tokens reservation settled to `used` tokens, and its budget hold to
        `spent` billionths (None: kept whole)."""
        if self.reservation is not None:
            self.reservation.settle(self.reservation.tokens if used is None else used)
        if self.hold is not None:
            self.hold.settle(self.hold.nanos if spent is None else spent)

    def held_from(self, other: Answers) -> None:
        self.reservation, self.hold = other.reservation, other.hold

    def headers(self) -> dict[str, str]:
        return {"x-cache": self.cache} if self.cache else {}

    def tokens(self, n: int = 1) -> Tokens:
        """The usage of these answers, `n` choices per prompt (items prompt by prompt): a
        prompt counts once, by its first choice, and as cached when that one came from the
        response cache."""
        firsts = range(0, len(self), n)
        return Tokens(
            sum(self[index].prompt_tokens for index in firsts),
            sum(answer.completion_tokens for answer in self),
            sum(self[index].prompt_tokens for index in firsts if index in self.from_cache),
        )


def charge(
    stats: RequestStats,
    caller: Caller,
    answers: Answers,
    price: Price,
    n: int = 1,
    *,
    embedding: bool = False,
) -> Tokens:
    """Count a 200 answer's usage and its cost at its model's `price` to its caller's key (in
    memory; anonymous: nothing), and settle its tokens reservation: its completion tokens
    (an embedding's, its input tokens). Answers without counts (anonymous /sample's) keep
    their reservation whole."""
    tokens = answers.tokens(n)
    counted = bool(tokens.prompt or tokens.completion or not answers)
    used = tokens.prompt if embedding else tokens.completion
    _record(stats, caller, tokens, price, answers, used if counted else None)
    return tokens


def charge_tokens(
    stats: RequestStats, caller: Caller, tokens: Tokens, price: Price, answers: Answers
) -> None:
    """Count `tokens` (what a stream cut short delivered) and their cost to the caller's key,
    and settle the request's tokens reservation to them."""
    _record(stats, caller, tokens, price, answers, tokens.completion)


def _record(
    stats: RequestStats, caller: Caller, tokens: Tokens, price: Price, answers: Answers,
    used: int | None,
) -> None:  # fmt: skip
    """`tokens` and their cost counted to the caller's key (nothing for none); the request's
    tokens reservation settled to `used`, its budget hold to the cost (None: kept whole)."""
    spend = price.of(tokens.prompt, tokens.completion)
    if spend or tokens.prompt or tokens.completion:
        stats.record_usage(caller.key_id, *tokens, spend_nanos=spend)
    answers.settle(used, None if used is None else spend)


class Entered(NamedTuple):
    """A request's items in their batches (or answered by the response cache): a ticket per
    item, and its answers so far (none yet, and what the cache did)."""

    tickets: list[Ticket]
    answers: Answers


def submit(
    process: RequestPath,
    caller: Caller,
    items: Sequence[str | SampleRequest],
    deadline: Deadline,
    *,
    price: Price | None = None,
    reserve: int | None = None,
) -> Answers | Failure:
    """Every item's answer (each a completion, in order), or why the request gets none.
    `price` and `reserve`: as enter's. A failure settles the request's reservation and budget
    hold to nothing."""
    entered = enter(process, caller, items, deadline, price=price, reserve=reserve)
    if isinstance(entered, Failure):
        return entered
    answers = entered.answers
    batches: dict[str, list[Any]] = {}  # several items may share a batch: read once
    for ticket in entered.tickets:
        answer = _wait(ticket, batches, deadline)
        failure = answer if isinstance(answer, Failure) else failure_of(answer, deadline)
        if failure is not None:
            answers.settle(0, 0)
            return failure
        assert isinstance(answer, Answer)
        answers.append(answer)
    return answers


def enter(
    process: RequestPath,
    caller: Caller,
    items: Sequence[str | SampleRequest],
    deadline: Deadline,
    *,
    stream: bool = False,
    price: Price | None = None,
    reserve: int | None = None,
) -> Entered | Failure:
    """The request's items joined to their batches, or why it cannot be. The items of a
    caller with a request limit join its key's shard, and the call raises its counter
    (accounts.ratelimit). A caller with a tokens limit reserves `reserve` tokens first (by
    default every item's max tokens; given, the request is an embedding's: its input's
    bound). A caller with a budget holds the most the request may cost at `price` (None: an
    anonymous endpoint's, nothing). With the response cache on, an item whose output its
    input determines is looked up in the same call (batching.cache): a hit joins no batch.
    `stream`: the items are marked streaming (their worker publishes their text as it comes)."""
    limited = process.limiter.check(caller)  # the model's requests per minute
    if limited is not None:
        return _limited(limited)
    policy = process.watcher.current
    queue = process.aggregator.queue
    digests = [cache.digest_of(queue, item, policy, caller.key_id) for item in items]
    if not any(digests):  # the response cache may answer a request without a call
        too_late = _too_late(process, deadline)
        if too_late is not None:
            return too_late
    answers = Answers()
    reservation = _reserve(process, caller, items, policy.max_new_tokens, reserve)
    if not isinstance(reservation, Reservation | None):
        return reservation
    answers.reservation = reservation
    hold = _hold(process, caller, items, policy.max_new_tokens, price, reserve)
    if not isinstance(hold, SpendHold | None):
        answers.settle(0, 0)
        return hold
    answers.hold = hold
    joining = list(zip(digests, items, strict=True))
    tickets = _join(process, caller, joining, policy.version, deadline, stream)
    if isinstance(tickets, Failure):
        answers.settle(0, 0)
        return tickets
    asked = sum(1 for digest in digests if digest)
    if asked:
        answers.from_cache = frozenset(
            index for index, ticket in enumerate(tickets) if ticket.cached is not None
        )
        hits = len(answers.from_cache)
        answers.cache = "hit" if hits == len(items) else "miss"
        process.stats.record_cache(hits, asked - hits)
        metrics.record_cache(hits, asked - hits)
    return Entered(tickets, answers)


def _too_late(process: RequestPath, deadline: Deadline) -> Failure | None:
    """The refusal of a request with less of its deadline left than its model's least work
    (serving.shedding.QuickestAnswers): it would end 504."""
    left_ms = deadline.remaining_ms()
    least_ms = process.quickest.least_work_ms(deadline.deadline_ms)
    if left_ms >= least_ms:
        return None
    return Failure(
        Problem.OVERLOADED,
        f"overloaded: predicted {least_ms:.0f} ms at least (this model's quickest recent "
        f"answers), more than the {left_ms} ms left of the {deadline.deadline_ms} ms deadline",
        1,
    )


def _reserve(
    process: RequestPath,
    caller: Caller,
    items: Sequence[str | SampleRequest],
    max_new_tokens: int,
    reserve: int | None,
) -> Reservation | Failure | None:
    """The request's tokens reserved in its key's window (None: no tokens limit), or its
    refusal: the key at its limit (429), Redis away (503)."""
    if not caller.tpm:
        return None
    if reserve is None:
        reserve = sum(max_new_tokens if isinstance(item, str) else
                      (item.max_tokens or max_new_tokens) for item in items)  # fmt: skip
    try:
        reserved = process.limiter.reserve(caller, reserve)
    except REDIS_FAULTS as exc:
        log.error("cannot reach Redis to reserve a request's tokens: %r", exc)
        return unavailable()
    return _limited(reserved) if isinstance(reserved, Limited) else reserved


def _hold(
    process: RequestPath,
    caller: Caller,
    items: Sequence[str | SampleRequest],
    max_new_tokens: int,
    price: Price | None,
    embedded: int | None,
) -> SpendHold | Failure | None:
    """The most the request may cost held against its key's budgets (None: no budget), or
    its refusal: what its key's requests in flight hold reaches what is left (429, in a
    second), its budget spent (429 insufficient_quota), Redis away (503). `embedded`: an
    embedding's input bound, its only tokens."""
    if process.budgets is None or price is None:
        return None
    if not caller.budget_nanos and not caller.owner_budget_nanos:
        return None
    nanos = most_cost(items, max_new_tokens, price, embedded)
    try:
        held = process.budgets.hold(caller, nanos)
    except REDIS_FAULTS as exc:
        log.error("cannot reach Redis to hold a request's budget: %r", exc)
        return unavailable()
    if not isinstance(held, str):
        return held
    if held in (KEY_HELD, OWNER_HELD):  # not spent yet: in a second, as answers settle
        return Failure(Problem.RATE_LIMITED, held, 1)
    return Failure(Problem.OVER_BUDGET, held)


def cancel(process: RequestPath, tickets: Sequence[Ticket]) -> None:
    """Mark the items of a streaming request whose client left (ShardKeys.cancelled): one
    not sealed yet takes no place in its call, and a running one's text stops (its worker
    reads them). Redis away: only logged, the items are sampled for no one."""
    by_batch: dict[str, list[int]] = {}
    for ticket in tickets:
        by_batch.setdefault(ticket.batch_id, []).append(ticket.index)
    aggregator = process.aggregator
    try:
        with process.client.pipeline(transaction=False) as pipe:
            for batch_id, indexes in by_batch.items():
                key = aggregator.shard_of(batch_id).cancelled(batch_id)
                pipe.sadd(key, *indexes)
                pipe.pexpire(key, aggregator.ttl_ms)
            pipe.execute()
    except REDIS_FAULTS as exc:
        log.warning("cannot mark %d items cancelled: %s", len(tickets), exc)


def _join(
    process: RequestPath,
    caller: Caller,
    items: list[tuple[str, str | SampleRequest]],
    version: int,
    deadline: Deadline,
    stream: bool = False,
) -> list[Ticket] | Failure:
    """Each item (with its cache digest) appended to its shard's open batch in one call, the
    batches it opened dispatched; or why the request is refused. A lone item of a caller far
    from its request limit joins by the plain MULTI, every other request by one script call
    (accounts.ratelimit)."""
    aggregator, limiter = process.aggregator, process.limiter
    shard = aggregator.shard_of_key(caller.key_id) if caller.rpm else None
    now_s = time.time()
    cost = limiter.cost(caller, len(items))
    counter_key = limiter.counter(caller, aggregator.shards[shard or 0], now_s)
    counter = (
        AppendCounter(counter_key, limiter.needs_expiry(caller, now_s)) if counter_key else None
    )
    budget_ms = deadline.remaining_ms()
    # Items carry their whole deadline once every live worker reads it (a rolling upgrade).
    whole_ms = deadline.deadline_ms if process.read_deadlines else 0
    try:
        if len(items) == 1 and not items[0][0] and not limiter.near(caller, cost, now_s):
            ticket = aggregator.append(
                items[0][1], budget_ms, shard, key_id=caller.key_id, counter=counter,
                lane=caller.priority, stream=stream, deadline_ms=whole_ms,
            )  # fmt: skip
            joined = Joined([ticket], ticket.counted)
        else:
            joined = aggregator.append_items(
                items, budget_ms, shard, key_id=caller.key_id, counter=counter, cost=cost,
                limit=caller.rpm, version=version, lane=caller.priority, stream=stream,
                deadline_ms=whole_ms,
            )  # fmt: skip
    except Exception as exc:  # any failure of the join's round trip: a 503
        # Not only RedisError: redis-py's cluster client raises RedisClusterException
        # when no master answers, and its pipeline has raised IndexError under load.
        trace = not isinstance(exc, REDIS_FAULTS)  # Redis away: one line, not a trace
        log.error("cannot reach Redis to queue a request: %r", exc, exc_info=trace)
        return unavailable()
    if joined.limited:
        return _limited(limiter.refused(caller, joined.counted, now_s))
    if joined.tickets[0].rejected:
        predicted_ms = joined.tickets[0].predicted_ms
        return Failure(
            Problem.OVERLOADED,
            f"overloaded: predicted {predicted_ms} ms exceeds the "
            f"{deadline.deadline_ms} ms deadline",
            max(1, math.ceil(predicted_ms / 1000)),
        )
    if counter is not None and joined.counted:
        limiter.counted(caller, joined.counted, now_s, expiry_set=bool(counter.expire_ms))
    for ticket in joined.tickets:
        if ticket.opened and not _dispatch(process, ticket.batch_id, ticket.lane):
            return unavailable()
    if counter is not None and joined.counted > caller.rpm:
        # The MULTI's raise passed the limit (other processes counted meanwhile): not served.
        limiter.give_back(counter.key, cost)
        return _limited(limiter.refused(caller, joined.counted - cost, now_s))
    JOINED_AT.set(time.monotonic())  # its batches have it, dispatched
    return joined.tickets


def _limited(limited: Limited) -> Failure:
    return Failure(Problem.RATE_LIMITED, limited.message, limited.retry_after_s)


def _wait(ticket: Ticket, batches: dict[str, list[Any]], deadline: Deadline) -> Answer | Failure:
    """The ticket's answer: from the response cache, or from its batch's result (read once
    per batch into `batches`, and only its own item decoded), within what is left of the
    deadline."""
    if ticket.cached is not None:
        return Answer.from_json(ticket.cached)
    try:
        results = batches.get(ticket.batch_id)
        if results is None:
            results = batches[ticket.batch_id] = celery_app.AsyncResult(ticket.batch_id).get(
                timeout=deadline.remaining_s()
            )
        return Answer.from_wire(results[ticket.index])
    except CeleryTimeoutError:
        return Failure(
            Problem.DEADLINE, f"no completion within the {deadline.deadline_ms} ms deadline"
        )
    except REDIS_FAULTS as exc:  # the batch's Redis node went down while it waited
        log.error("batch %s: its results cannot arrive: %s", ticket.batch_id, exc)
        return unavailable()
    except Exception as exc:  # noqa: BLE001 - whatever broke the batch: a 502
        log.error("batch %s failed: %s", ticket.batch_id, exc)
        return Failure(Problem.SAMPLER_FAILED, "the sampler failed for this batch")


def failure_of(answer: Answer, deadline: Deadline) -> Failure | None:
    """The request's failure when one of its items got no completion."""
    problem = answer.problem
    if problem is None:
        return None
    if problem is Problem.DEADLINE:
        message = f"no completion within the {deadline.deadline_ms} ms deadline ({answer.text})"
    elif problem is Problem.PROMPT_REJECTED:
        message = f"prompt rejected by the model: {answer.text}"
    elif problem is Problem.UNAVAILABLE:
        message = QUEUE_UNAVAILABLE
    else:
        message = answer.text
    return Failure(problem, message)


def _dispatch(process: RequestPath, batch_id: str, lane: int) -> bool:
    """Send the batch's task (task id = batch id, by name: no import of the worker's code), at
    its lane's Celery priority. When it cannot be sent, close the batch so that no later
    request joins it, and answer the members that joined already at once rather than at
    their deadline."""
    aggregator = process.aggregator
    try:
        celery_app.send_task(
            RUN_BATCH_TASK,
            args=(batch_id, aggregator.queue, lane),
            task_id=batch_id,
            queue=aggregator.queue,
            priority=task_priority(lane),
            retry_policy=PUBLISH_RETRY,
            # A message older than its batch's data is stale work: a worker drops it unrun
            # (after a broker outage, say) instead of sealing what has expired.
            expires=aggregator.ttl_s,
        )
    except Exception as exc:  # noqa: BLE001 - kombu raises OperationalError, OSError and more
        log.error("cannot dispatch batch %s: %s", batch_id, exc)
        _abandon(process, batch_id, lane)
        return False
    try:
        aggregator.dispatched(batch_id, lane)
    except REDIS_FAULTS as exc:
        # Harmless: a later request sends the task again, and the duplicate answers nothing.
        log.warning("batch %s dispatched but not confirmed: %s", batch_id, exc)
    return True


def _abandon(process: RequestPath, batch_id: str, lane: int) -> None:
    aggregator = process.aggregator
    try:
        members = aggregator.abandon(batch_id, lane)
        answers = [Answer(ItemOutcome.NOT_DISPATCHED, QUEUE_UNAVAILABLE)] * members
        # Stored and published as the task would have: every member's wait wakes now.
        backend = celery_app.backend
        assert isinstance(backend, RedisBackend)  # CELERY_RESULT_BACKEND is ours
        with process.client.pipeline(transaction=False) as pipe:
            queue_result(pipe, backend, batch_id, to_wire(answers), expires_s=aggregator.ttl_s)
            pipe.execute()
    except Exception as exc:  # noqa: BLE001 - Redis down too: the members time out instead
        log.error("batch %s abandoned, its members not answered: %s", batch_id, exc)
