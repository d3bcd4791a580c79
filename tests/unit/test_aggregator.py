"""The aggregator's Lua logic against a real Redis server."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from batching import admission
from batching.admission import AdmissionInputs
from batching.aggregator import ADMISSION_REFRESH_S, DISPATCH_GRACE_MS, BatchAggregator
from batching.items import Ticket
from batching.keys import tag_of
from tests.support import unique_queue
from tests.support.clocks import SetClock, redis_ms
from tests.support.queue_views import workers_of


@pytest.fixture
def aggregator(redis_client: redis.Redis) -> BatchAggregator:
    return BatchAggregator(redis_client, unique_queue("agg"), max_batch_size=100, deadline_ms=500)


def test_first_append_opens_and_later_ones_join(aggregator: BatchAggregator) -> None:
    first = aggregator.append("p0", 500)
    second = aggregator.append("p1", 500)
    assert first.opened
    assert not second.opened
    assert first.batch_id == second.batch_id
    assert (first.index, second.index) == (0, 1)
    sealed = aggregator.seal(first.batch_id)
    assert [i.prompt for i in sealed.items] == ["p0", "p1"]
    assert sealed.items[0].expires_at_ms - sealed.now_ms <= 500
    assert sealed.opened_at_ms <= sealed.now_ms
    assert not sealed.sealed_before


def test_an_item_holds_its_expiry_deadline_and_prompt_only(aggregator: BatchAggregator) -> None:
    """Nothing per request is stored that no one reads (a request id was, once)."""
    ticket = aggregator.append("a prompt", 400, deadline_ms=500)
    (raw,) = aggregator.client.lrange(aggregator.shards[0].pending, 0, -1)
    head, prompt = raw.split(b" ", 1)
    assert prompt == b"a prompt"
    expires, whole = head.split(b"~")
    item = aggregator.seal(ticket.batch_id).items[0]
    assert (int(expires), int(whole)) == (item.expires_at_ms, item.request_deadline_ms)
    assert item.request_deadline_ms == 500  # the whole deadline, though 400 ms were left
    assert item.arrived_at_ms(policy_deadline_ms=9999) == item.expires_at_ms - 500


def test_full_batch_closes_in_the_same_call(redis_client: redis.Redis) -> None:
    aggregator = BatchAggregator(redis_client, unique_queue("full"), max_batch_size=3)
    tickets = [aggregator.append(f"p{i}", 500) for i in range(7)]
    assert [t.opened for t in tickets] == [True, False, False, True, False, False, True]
    assert [t.index for t in tickets] == [0, 1, 2, 0, 1, 2, 0]
    assert len({t.batch_id for t in tickets}) == 3
    assert len(aggregator.seal(tickets[0].batch_id).items) == 3


def test_prompts_with_spaces_newlines_and_unicode_survive(aggregator: BatchAggregator) -> None:
    prompt = "  two  spaces\nnew line 大 \x00 end "
    ticket = aggregator.append(prompt, 500)
    assert aggregator.seal(ticket.batch_id).items[0].prompt == prompt


def test_seal_takes_everything_so_far_and_later_appends_open_a_new_batch(
    aggregator: BatchAggregator,
) -> None:
    a = aggregator.append("a", 500)
    aggregator.append("b", 500)
    assert len(aggregator.seal(a.batch_id).items) == 2
    c = aggregator.append("c", 500)
    assert c.opened
    assert c.batch_id != a.batch_id
    again = aggregator.seal(a.batch_id)  # sealing twice finds nothing more
    assert again.items == []
    assert again.sealed_before


def test_batch_data_expires_on_its_own(aggregator: BatchAggregator) -> None:
    aggregator.dispatched(aggregator.append("p", 500).batch_id)  # as the view does
    pending_ttl = aggregator.client.pttl(aggregator.shards[0].pending)
    open_ttl = aggregator.client.pttl(aggregator.shards[0].open_batch)
    assert 0 < pending_ttl <= aggregator.ttl_ms
    assert 0 < open_ttl <= aggregator.ttl_ms
    full = BatchAggregator(aggregator.client, unique_queue("ttl"), max_batch_size=1)
    closed = full.append("q", 500)  # fills a batch of one: it waits for its seal in its own list
    closed_ttl = aggregator.client.pttl(full.shards[0].batch(closed.batch_id))
    assert 0 < closed_ttl <= full.ttl_ms
    assert aggregator.ttl_ms <= 10 * aggregator.deadline_ms


def test_concurrent_appends_never_lose_or_duplicate(redis_url: str) -> None:
    """8 threads append 1,500 items while a sealer seals whatever batch is open."""
    queue = unique_queue("race")
    total_per_thread = 200
    threads = 8
    tickets: list[tuple[str, int, str]] = []
    lock = threading.Lock()
    appending = threading.Event()
    appending.set()

    def producer(n: int) -> None:
        aggregator = BatchAggregator(redis.Redis.from_url(redis_url), queue, max_batch_size=37)
        for i in range(total_per_thread):
            request_id = f"{n}-{i}"
            ticket = aggregator.append(request_id, 5000)
            with lock:
                tickets.append((ticket.batch_id, ticket.index, request_id))

    sealed: dict[str, list[str]] = {}

    def sealer() -> None:
        aggregator = BatchAggregator(redis.Redis.from_url(redis_url), queue, max_batch_size=37)
        while appending.is_set():
            batch_id = aggregator.open_batch_id()
            if batch_id:
                # The seal may take an older, closed batch first (the task's own then follows).
                batch = aggregator.seal(batch_id)
                sealed.setdefault(batch.batch_id, []).extend(i.prompt for i in batch.items)

    sealing = threading.Thread(target=sealer)
    sealing.start()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(producer, range(threads)))
    appending.clear()
    sealing.join()
    # Seal what is left (batches closed by size and never sealed by the sealer thread).
    aggregator = BatchAggregator(redis.Redis.from_url(redis_url), queue, max_batch_size=37)
    for _ in range(len(tickets)):
        left = {t[0] for t in tickets} - set(sealed)
        if not left:
            break
        batch = aggregator.seal(left.pop())  # unsealed: it seals one of them
        assert batch.batch_id in left | {batch.batch_id} - set(sealed)
        sealed[batch.batch_id] = [i.prompt for i in batch.items]

    assert len(tickets) == threads * total_per_thread
    everything = [rid for items in sealed.values() for rid in items]
    assert sorted(everything) == sorted(t[2] for t in tickets)  # nothing lost, nothing twice
    for batch_id, index, request_id in tickets:  # each ticket points at its own item
        assert sealed[batch_id][index] == request_id
    assert max(len(items) for items in sealed.values()) <= 37
    assert any(0 < len(items) < 37 for items in sealed.values())  # the sealer did race


def joined(aggregator: BatchAggregator, budget_ms: int) -> Ticket:
    """A request as the view makes it: append, and confirm the send of a batch it opened."""
    ticket = aggregator.append("p", budget_ms)
    if ticket.opened:
        aggregator.dispatched(ticket.batch_id)
    return ticket


def another_process(
    aggregator: BatchAggregator, max_batch_size: int = 100, monotonic: SetClock | None = None
) -> BatchAggregator:
    """An aggregator of the same queue that has read no admission figure yet."""
    return BatchAggregator(
        aggregator.client,
        aggregator.queue,
        max_batch_size=max_batch_size,
        monotonic=monotonic or time.monotonic,
    )


GRACE_MS = DISPATCH_GRACE_MS


def test_admission_refuses_only_a_backlog_that_cannot_meet_the_deadline(
    aggregator: BatchAggregator,
) -> None:
    # No live worker: always accepted (the request waits for its deadline).
    assert not joined(aggregator, 10).rejected
    aggregator.refresh_admission(AdmissionInputs(workers=1, turn_ms=100))  # a heartbeat
    # One batch open, none ahead of it: accepted even with a budget below one call.
    assert not joined(another_process(aggregator), 50).rejected
    # A worker takes it; then batches of one pile up behind the single worker.
    open_batch = aggregator.open_batch_id()
    assert open_batch is not None
    aggregator.seal(open_batch)
    clock = SetClock()
    backlog = another_process(aggregator, max_batch_size=1, monotonic=clock)
    for _ in range(4):
        assert not joined(backlog, 500).rejected
    # 4 batches unsealed, 1 worker: the next batch would wait for them and for the call
    # that may have just started, then take its own: about 600 ms in the worst case. Each
    # batch that closed refreshed the figure: no heartbeat was needed.
    refused = another_process(aggregator).append("p", 500)
    assert refused.rejected
    assert refused.predicted_ms == admission.predicted_ms(4, 1, 100)
    assert not another_process(aggregator).append("p", refused.predicted_ms).rejected  # patient
    # The process that filled the backlog read the figure before its last batch counted: it
    # admits requests until it reads the figure again (with a push, ADMISSION_REFRESH_S after
    # its last read), and refuses the next.
    clock.skew_s += 2 * ADMISSION_REFRESH_S
    assert not joined(backlog, 500).rejected
    assert joined(backlog, 500).rejected
    # Two workers halve the prediction.
    aggregator.refresh_admission(AdmissionInputs(workers=2, turn_ms=100))
    assert not another_process(aggregator).append("p", 500).rejected


def test_a_seal_refreshes_admission_with_the_sealers_figures(
    aggregator: BatchAggregator,
) -> None:
    backlog = another_process(aggregator, max_batch_size=1)
    tickets = [joined(backlog, 500) for _ in range(6)]
    assert not any(ticket.rejected for ticket in tickets)  # no worker has said anything yet
    backlog.seal(tickets[0].batch_id, AdmissionInputs(workers=1, turn_ms=100))
    assert another_process(aggregator).append("p", 500).rejected  # 5 ahead of one worker
    backlog.seal(tickets[1].batch_id, AdmissionInputs(workers=4, turn_ms=100))
    assert not another_process(aggregator).append("p", 500).rejected  # 4 workers: in time


def test_a_seal_records_when_its_call_ends_and_admission_counts_from_it(
    aggregator: BatchAggregator, redis_client: redis.Redis
) -> None:
    backlog = another_process(aggregator, max_batch_size=1)
    tickets = [joined(backlog, 500) for _ in range(3)]
    inputs = AdmissionInputs(workers=1, turn_ms=100)
    now = redis_ms(redis_client)
    aggregator.seal(tickets[0].batch_id, inputs, now_ms=now)
    ends = aggregator.shards[0].call_ends
    assert redis_client.zrange(ends, 0, -1, withscores=True) == [
        (tickets[0].batch_id.encode(), now + 100)
    ]
    # Two batches ahead; the call just sealed has a whole turn to go: the worst case.
    assert aggregator.refresh_admission(inputs, now_ms=now) == [admission.predicted_ms(2, 1, 100)]
    # 70 ms later it ends in 30 ms: the newcomer's batch finishes a margin after that, then
    # the batch ahead's call and its own.
    later = aggregator.refresh_admission(inputs, now_ms=now + 70)
    assert later == [round(admission.predicted_ms(2, 1, 100, frees=[30]) or 0)]
    assert later[0] < admission.predicted_ms(2, 1, 100)  # type: ignore[operator]
    # A seal that takes nothing (its batch sealed already) starts no call: nothing recorded.
    aggregator.seal(tickets[0].batch_id, inputs, now_ms=now + 80)
    assert redis_client.zcard(ends) == 1
    # The next call's end replaces it: one worker, one running call.
    aggregator.seal(tickets[1].batch_id, inputs, now_ms=now + 100)
    assert redis_client.zrange(ends, 0, -1, withscores=True) == [
        (tickets[1].batch_id.encode(), now + 200)
    ]


def test_shards_spread_requests_and_keep_their_own_batches(redis_client: redis.Redis) -> None:
    sharded = BatchAggregator(redis_client, unique_queue("shards"), shards=3)
    tickets = [sharded.append(f"p{i}", 500) for i in range(9)]
    batch_ids = {ticket.batch_id for ticket in tickets}
    assert len(batch_ids) == 3  # one open batch per shard, taken in turn
    assert {tag_of(batch_id) for batch_id in batch_ids} == {keys.tag for keys in sharded.shards}
    for batch_id in batch_ids:
        sealed = sharded.seal(batch_id)
        assert sorted(item.prompt for item in sealed.items) == sorted(
            f"p{i}" for i, ticket in enumerate(tickets) if ticket.batch_id == batch_id
        )
    assert len({key_slot(keys.open_batch.encode()) for keys in sharded.shards}) == 3


def test_heartbeats_count_live_workers(aggregator: BatchAggregator) -> None:
    assert workers_of(aggregator).live_count() == 0
    assert workers_of(aggregator).heartbeat("gpu0") == 1
    assert workers_of(aggregator).heartbeat("gpu1") == 2
    assert workers_of(aggregator).heartbeat("gpu0") == 2
    workers_of(aggregator).forget("gpu0")
    assert workers_of(aggregator).live_count() == 1


def test_items_carry_their_deadline_only_while_every_live_worker_reads_it(
    aggregator: BatchAggregator,
) -> None:
    """A worker of the release before heartbeats into the live workers alone (its
    heartbeat.lua): while it is live, web processes write the head it reads."""
    registry = workers_of(aggregator)
    assert registry.live() == (0, False)  # no worker: nothing to gate on
    registry.heartbeat("new")
    assert registry.live() == (1, True)
    seconds, micros = aggregator.client.time()
    aggregator.client.zadd(aggregator.keys.live_workers, {"older": seconds * 1000 + micros // 1000})
    assert registry.live() == (2, False)
    aggregator.client.zrem(aggregator.keys.live_workers, "older")  # its goodbye
    assert registry.live() == (1, True)
    registry.forget("new")
    assert registry.live() == (0, False)
    assert aggregator.client.zcard(aggregator.keys.deadline_readers) == 0


def test_max_batch_size_is_bounded(redis_client: redis.Redis) -> None:
    for bad in (0, 101):
        with pytest.raises(ValueError, match="max_batch_size must be"):
            BatchAggregator(redis_client, "q", max_batch_size=bad)


def test_ticket_batch_ids_are_unique_across_queues(redis_client: redis.Redis) -> None:
    a = BatchAggregator(redis_client, unique_queue("a")).append("p", 500)
    b = BatchAggregator(redis_client, unique_queue("b")).append("p", 500)
    assert a.opened
    assert b.opened
    assert a.batch_id != b.batch_id


def test_a_batch_whose_send_is_not_confirmed_is_handed_over_once(
    aggregator: BatchAggregator,
) -> None:
    """The opener died between its append and its Celery send: after DISPATCH_GRACE_MS a
    worker's scan is told to send the batch's task, and only that one."""
    now = redis_ms(aggregator.client)
    orphan = aggregator.append("joined a batch no task will seal", 500, now_ms=now)
    assert orphan.opened
    assert aggregator.take_due_handovers(now_ms=now + GRACE_MS - 1) == []  # too soon to tell
    assert aggregator.take_due_handovers(now_ms=now + GRACE_MS) == [orphan.batch_id]
    assert aggregator.take_due_handovers(now_ms=now + GRACE_MS) == []  # re-armed for the taker
    aggregator.dispatched(orphan.batch_id, now_ms=now + GRACE_MS)  # the taker's send went through
    assert aggregator.take_due_handovers(now_ms=now + 3 * GRACE_MS) == []


def test_a_seal_takes_the_batches_due_for_a_hand_over(aggregator: BatchAggregator) -> None:
    """Under load a worker seals often: its seal takes the shard's due hand-overs, so no
    scan is needed."""
    full = BatchAggregator(aggregator.client, aggregator.queue, max_batch_size=1)
    now = redis_ms(aggregator.client)
    orphan = full.append("in a batch whose task was never sent", 500, now_ms=now)
    running = full.append("in the next batch, sealed by a worker", 500, now_ms=now)
    assert full.seal(running.batch_id, now_ms=now + GRACE_MS).handovers == [orphan.batch_id]
    assert aggregator.take_due_handovers(now_ms=now + GRACE_MS) == []  # taken by the seal


def test_a_confirmed_or_sealed_batch_is_never_handed_over(aggregator: BatchAggregator) -> None:
    now = redis_ms(aggregator.client)
    confirmed = aggregator.append("p", 500, now_ms=now)
    aggregator.dispatched(confirmed.batch_id, now_ms=now)
    aggregator.seal(confirmed.batch_id, now_ms=now)
    unconfirmed = aggregator.append("p", 500, now_ms=now)  # sealed before any confirmation
    aggregator.seal(unconfirmed.batch_id, now_ms=now)
    assert aggregator.take_due_handovers(now_ms=now + GRACE_MS) == []


def test_an_abandoned_batch_takes_no_more_members(aggregator: BatchAggregator) -> None:
    now = redis_ms(aggregator.client)
    first = aggregator.append("p0", 500, now_ms=now)
    aggregator.append("p1", 500, now_ms=now)
    assert aggregator.abandon(first.batch_id, now_ms=now) == 2
    after = aggregator.append("p2", 500, now_ms=now)
    assert after.opened
    assert after.batch_id != first.batch_id
    # Only the batch still waiting for its send is handed over; the abandoned one is no one's.
    assert aggregator.take_due_handovers(now_ms=now + GRACE_MS) == [after.batch_id]


def test_a_held_batch_its_worker_does_not_seal_is_handed_over_once(
    aggregator: BatchAggregator,
) -> None:
    """A worker received the batch's task ahead of its seal and died: a grace after the seal
    it expected, another worker's scan is told to send the task again; once, since the
    holder may only be slow, and a second send queues like any task."""
    now = redis_ms(aggregator.client)
    held = aggregator.append("held by a worker that dies", 5000, now_ms=now)
    aggregator.dispatched(held.batch_id, now_ms=now)  # sent: no hand-over for the dispatch
    assert aggregator.hold(held.batch_id, seal_in_ms=50, now_ms=now)
    # A late confirmation of the dispatch cannot cancel the hold.
    aggregator.dispatched(held.batch_id, now_ms=now + 10)
    due = now + 50 + GRACE_MS
    assert aggregator.take_due_handovers(now_ms=due - 1) == []  # before the grace
    assert aggregator.take_due_handovers(now_ms=due) == [held.batch_id]
    assert aggregator.take_due_handovers(now_ms=due + GRACE_MS) == []


def test_a_sealed_batch_is_neither_held_nor_handed_over(aggregator: BatchAggregator) -> None:
    now = redis_ms(aggregator.client)
    held = aggregator.append("sealed in time", 5000, now_ms=now)
    aggregator.dispatched(held.batch_id, now_ms=now)
    assert aggregator.hold(held.batch_id, seal_in_ms=0, now_ms=now)
    assert aggregator.seal(held.batch_id, now_ms=now).items  # its worker sealed it
    assert not aggregator.hold(held.batch_id, seal_in_ms=0, now_ms=now)  # nothing left to hold
    assert aggregator.take_due_handovers(now_ms=now + GRACE_MS) == []


def test_an_append_survives_a_pooled_connection_that_redis_closed(redis_url: str) -> None:
    """A pooled connection gone stale (Redis restarted, or closed it) costs a reconnect, not
    the request."""
    client = redis.Redis.from_url(redis_url)  # its own pool: one connection, used in turn
    aggregator = BatchAggregator(client, unique_queue("stale"))
    first = aggregator.append("before", 500)
    stale_id = client.client_id()
    assert redis.Redis.from_url(redis_url).client_kill_filter(_id=stale_id) == 1
    second = aggregator.append("after", 500)
    assert client.client_id() != stale_id  # it did go through a new connection
    assert (second.batch_id, second.index) == (first.batch_id, 1)
    assert [item.prompt for item in aggregator.seal(first.batch_id).items] == ["before", "after"]


def test_an_error_inside_the_append_is_raised_and_its_connection_stays_usable(
    redis_client: redis.Redis,
) -> None:
    aggregator = BatchAggregator(redis_client, unique_queue("wrongtype"))
    keys = aggregator.shards[0]
    redis_client.set(keys.pending, "not a list")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        aggregator.append("p", 500)
    redis_client.delete(keys.pending, keys.open_batch)
    ticket = aggregator.append("p", 500)
    assert (ticket.opened, ticket.index) == (True, 0)
    assert [item.prompt for item in aggregator.seal(ticket.batch_id).items] == ["p"]


class SlowToSend(redis.Redis):
    """A client whose first script call takes `delay_s` longer before it reaches Redis, as a
    first round trip that connects and loads the script on busy cores does: the process's
    clock moves on by `delay_s` while the node's does not."""

    def __init__(self, url: str, delay_s: float, clock: SetClock) -> None:
        pool = redis.ConnectionPool.from_url(url)
        super().__init__(connection_pool=pool)
        self.delay_s = delay_s
        self.clock = clock

    def evalsha(self, *args: Any, **kwargs: Any) -> Any:
        delay_s, self.delay_s = self.delay_s, 0.0
        self.clock.skew_s += delay_s
        return super().evalsha(*args, **kwargs)


def test_a_deadline_is_never_later_than_its_budget_in_redis_time(redis_url: str) -> None:
    """A web process's estimate of the node's time is never ahead of it, even when its first
    TIME round trip was slow: else an item's deadline lay past its budget and a worker would
    sample it after its request had given up."""
    clock = SetClock(frozen=False)
    client = SlowToSend(redis_url, delay_s=0.2, clock=clock)
    aggregator = BatchAggregator(client, unique_queue("clock"), deadline_ms=500, monotonic=clock)
    for budget_ms in (0, 80):
        ticket = aggregator.append(f"budget {budget_ms}", budget_ms)
        seconds, micros = redis.Redis.from_url(redis_url).time()
        redis_now_ms = seconds * 1000 + micros / 1000
        (item,) = aggregator.seal(ticket.batch_id).items
        assert item.expires_at_ms <= redis_now_ms + budget_ms
