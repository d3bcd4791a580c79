"""A request's items appended by one call (BatchAggregator.append_items, a script): across as
many batches as they fill, with the request's rate limit decided by Redis before anything
joins (real Redis)."""

from __future__ import annotations

import redis

from batching.aggregator import BatchAggregator
from batching.generation import SampleRequest
from batching.join import AppendCounter
from tests.support import unique_queue


def prompts(n: int) -> list[tuple[str, str | SampleRequest]]:
    return [("", f"E equals {i} ") for i in range(n)]


def test_many_items_join_in_one_round_trip_across_batches(redis_client: redis.Redis) -> None:
    aggregator = BatchAggregator(redis_client, unique_queue("items"), max_batch_size=4)
    first = aggregator.append("before ", 500)  # a batch someone else opened
    script = aggregator._scripts["append_items"]
    calls = []

    def counted_call(**kwargs: object) -> object:
        calls.append(kwargs)
        return script(**kwargs)

    aggregator._scripts["append_items"] = counted_call
    tickets = aggregator.append_items(prompts(9), 500, shard=0).tickets
    assert len(calls) == 1  # one round trip
    by_batch = [[t.index for t in tickets if t.batch_id == b] for b in dict.fromkeys(
        t.batch_id for t in tickets)]  # fmt: skip
    assert by_batch == [[1, 2, 3], [0, 1, 2, 3], [0, 1]]
    assert tickets[0].batch_id == first.batch_id
    # The request dispatches the batches it opened, once each.
    assert [t.opened for t in tickets] == [False] * 3 + [True, False, False, False, True, False]
    # The full ones are closed (waiting for their seal, whole), the last one is open.
    sealed = [aggregator.seal(bid).items for bid in dict.fromkeys(t.batch_id for t in tickets)]
    assert [[item.prompt for item in items] for items in sealed] == [
        ["before ", "E equals 0 ", "E equals 1 ", "E equals 2 "],
        [f"E equals {i} " for i in range(3, 7)],
        ["E equals 7 ", "E equals 8 "],
    ]


def test_a_batch_overfilled_by_plain_appends_is_closed_before_items_join(
    redis_client: redis.Redis,
) -> None:
    aggregator = BatchAggregator(redis_client, unique_queue("items"), max_batch_size=2)
    keys = aggregator.shards[0]
    opened = aggregator.append("a ", 500)
    redis_client.rpush(keys.pending, b"0 b ", b"0 c ")  # two MULTIs that pushed beyond
    [ticket] = aggregator.append_items(prompts(1), 500, shard=0).tickets
    assert ticket.batch_id != opened.batch_id
    assert (ticket.index, ticket.opened) == (0, True)
    assert [item.prompt for item in aggregator.seal(opened.batch_id).items] == ["a ", "b "]


def test_the_limit_refuses_a_request_that_does_not_fit_and_appends_nothing(
    redis_client: redis.Redis,
) -> None:
    aggregator = BatchAggregator(redis_client, unique_queue("items"))
    counter = AppendCounter(aggregator.shards[0].requests_counter(5, 1), 60_000)
    served = aggregator.append_items(prompts(3), 500, 0, key_id=5, counter=counter, cost=3,
                                     limit=4)  # fmt: skip
    assert (served.limited, served.counted, len(served.tickets)) == (False, 3, 3)
    refused = aggregator.append_items(prompts(2), 500, 0, key_id=5, counter=counter, cost=2,
                                      limit=4)  # fmt: skip
    assert (refused.limited, refused.counted, refused.tickets) == (True, 3, [])
    last = aggregator.append_items(prompts(1), 500, 0, key_id=5, counter=counter, limit=4)
    assert (last.limited, last.counted) == (False, 4)
    assert int(redis_client.get(counter.key) or 0) == 4
    assert 0 < redis_client.pttl(counter.key) <= 60_000
    assert len(aggregator.seal(served.tickets[0].batch_id).items) == 4
