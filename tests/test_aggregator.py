"""The aggregator's Lua logic against a real Redis server."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from sampling.aggregator import BatchAggregator
from tests.conftest import unique_queue


@pytest.fixture
def aggregator(redis_client: redis.Redis) -> BatchAggregator:
    return BatchAggregator(redis_client, unique_queue("agg"), max_batch_size=100, deadline_ms=500)


def test_first_append_opens_and_later_ones_join(aggregator: BatchAggregator) -> None:
    first = aggregator.append("r0", "p0", 500)
    second = aggregator.append("r1", "p1", 500)
    assert first.opened and not second.opened
    assert first.batch_id == second.batch_id
    assert (first.index, second.index) == (0, 1)
    sealed = aggregator.seal(first.batch_id)
    assert [(i.request_id, i.prompt) for i in sealed.items] == [("r0", "p0"), ("r1", "p1")]
    assert sealed.items[0].deadline_ms - sealed.now_ms <= 500
    assert sealed.opened_at_ms <= sealed.now_ms


def test_full_batch_closes_in_the_same_call(redis_client: redis.Redis) -> None:
    aggregator = BatchAggregator(redis_client, unique_queue("full"), max_batch_size=3)
    tickets = [aggregator.append(f"r{i}", f"p{i}", 500) for i in range(7)]
    assert [t.opened for t in tickets] == [True, False, False, True, False, False, True]
    assert [t.index for t in tickets] == [0, 1, 2, 0, 1, 2, 0]
    assert len({t.batch_id for t in tickets}) == 3
    assert len(aggregator.seal(tickets[0].batch_id).items) == 3


def test_prompts_with_spaces_newlines_and_unicode_survive(aggregator: BatchAggregator) -> None:
    prompt = "  two  spaces\nnew line 大 \x00 end "
    ticket = aggregator.append("r", prompt, 500)
    assert aggregator.seal(ticket.batch_id).items[0].prompt == prompt


def test_seal_takes_everything_so_far_and_later_appends_open_a_new_batch(
    aggregator: BatchAggregator,
) -> None:
    a = aggregator.append("a", "a", 500)
    aggregator.append("b", "b", 500)
    assert len(aggregator.seal(a.batch_id).items) == 2
    c = aggregator.append("c", "c", 500)
    assert c.opened and c.batch_id != a.batch_id
    assert aggregator.seal(a.batch_id).items == []  # sealing twice finds nothing more


def test_batch_data_expires_on_its_own(aggregator: BatchAggregator) -> None:
    ticket = aggregator.append("r", "p", 500)
    batch_ttl = aggregator.client.pttl(aggregator.batch_prefix + ticket.batch_id)
    open_ttl = aggregator.client.pttl(aggregator.open_key)
    assert 0 < batch_ttl <= aggregator.ttl_ms
    assert 0 < open_ttl <= aggregator.ttl_ms
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
            ticket = aggregator.append(request_id, request_id, 5000)
            with lock:
                tickets.append((ticket.batch_id, ticket.index, request_id))

    sealed: dict[str, list[str]] = {}

    def sealer() -> None:
        aggregator = BatchAggregator(redis.Redis.from_url(redis_url), queue, max_batch_size=37)
        while appending.is_set():
            batch_id = aggregator.client.get(aggregator.open_key)
            if batch_id:
                items = aggregator.seal(batch_id.decode()).items
                sealed.setdefault(batch_id.decode(), []).extend(i.request_id for i in items)

    sealing = threading.Thread(target=sealer)
    sealing.start()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(producer, range(threads)))
    appending.clear()
    sealing.join()
    # Seal what is left (batches closed by size and never sealed by the sealer thread).
    aggregator = BatchAggregator(redis.Redis.from_url(redis_url), queue, max_batch_size=37)
    for batch_id in {t[0] for t in tickets} - set(sealed):
        sealed[batch_id] = [i.request_id for i in aggregator.seal(batch_id).items]

    assert len(tickets) == threads * total_per_thread
    everything = [rid for items in sealed.values() for rid in items]
    assert sorted(everything) == sorted(t[2] for t in tickets)  # nothing lost, nothing twice
    for batch_id, index, request_id in tickets:  # each ticket points at its own item
        assert sealed[batch_id][index] == request_id
    assert max(len(items) for items in sealed.values()) <= 37
    assert any(0 < len(items) < 37 for items in sealed.values())  # the sealer did race


def test_admission_refuses_only_a_backlog_that_cannot_meet_the_deadline(
    aggregator: BatchAggregator,
) -> None:
    # No live worker: always accepted (the request waits for its deadline).
    assert not aggregator.append("r", "p", 10).rejected
    aggregator.heartbeat("w1")
    aggregator.publish_sampler_ms(100)
    # One batch open, none ahead of it: accepted even with a budget below one call.
    assert not aggregator.append("r", "p", 50).rejected
    # Close the open batch by filling it, so batches pile up behind the single worker.
    backlog = BatchAggregator(aggregator.client, aggregator.queue, max_batch_size=1)
    for i in range(4):
        assert not backlog.append(f"b{i}", "p", 500).rejected
    # 4 batches unsealed, 1 worker: the next batch would wait for them and for the call
    # that may have just started, then take its own: about 600 ms in the worst case.
    refused = backlog.append("late", "p", 500)
    assert refused.rejected
    assert refused.predicted_ms == 600
    assert not backlog.append("patient", "p", 700).rejected
    # Two workers halve the prediction.
    aggregator.heartbeat("w2")
    assert not backlog.append("shared", "p", 500).rejected


def test_heartbeats_count_live_workers(aggregator: BatchAggregator) -> None:
    assert aggregator.live_workers() == 0
    assert aggregator.heartbeat("gpu0") == 1
    assert aggregator.heartbeat("gpu1") == 2
    assert aggregator.heartbeat("gpu0") == 2
    aggregator.forget_worker("gpu0")
    assert aggregator.live_workers() == 1


def test_max_batch_size_is_bounded(redis_client: redis.Redis) -> None:
    for bad in (0, 101):
        with pytest.raises(ValueError):
            BatchAggregator(redis_client, "q", max_batch_size=bad)


def test_ticket_batch_ids_are_unique_across_queues(redis_client: redis.Redis) -> None:
    a = BatchAggregator(redis_client, unique_queue("a")).append(uuid.uuid4().hex, "p", 500)
    b = BatchAggregator(redis_client, unique_queue("b")).append(uuid.uuid4().hex, "p", 500)
    assert a.opened and b.opened and a.batch_id != b.batch_id
