"""The response cache against a real Redis: which requests it may answer, the digest that
names an answer, and the append that returns a cached answer instead of joining a batch."""

from __future__ import annotations

import json
from dataclasses import replace

import redis

from batching import cache
from batching.aggregator import BatchAggregator
from batching.answers import Answer
from batching.generation import SampleRequest
from batching.items import Item
from batching.join import AppendCounter
from batching.outcomes import ItemOutcome
from batching.policy import GenerationSettings, Policy
from tests.support import unique_queue
from workers.runner import BatchRunner
from workers.samplers.simulated import SimulatedSampler

ON = Policy(response_cache=True, temperature=0.0)


def test_only_inputs_that_determine_their_output_are_cached() -> None:
    queue = "q"
    assert cache.digest_of(queue, "E equals ", Policy()) == ""  # off by default
    greedy = cache.digest_of(queue, "E equals ", ON)
    assert greedy
    assert greedy == cache.digest_of(queue, "E equals ", ON)
    assert cache.digest_of(queue, "E equals ", replace(ON, temperature=0.7)) == ""
    hot = SampleRequest(prompt="E equals ", temperature=0.7)
    assert cache.digest_of(queue, hot, ON) == ""
    seeded = cache.digest_of(queue, replace(hot, seed=3), ON)
    assert seeded
    # Every setting, the model, the endpoint's shape and the policy's defaults are part of it.
    others = {
        cache.digest_of(queue, replace(hot, seed=4), ON),
        cache.digest_of(queue, replace(hot, seed=3, max_tokens=5), ON),
        cache.digest_of(queue, replace(hot, seed=3, stop=("x",)), ON),
        cache.digest_of("other", replace(hot, seed=3), ON),
        cache.digest_of(queue, SampleRequest(prompt="E equals "), ON),
        cache.digest_of(queue, "E equals ", replace(ON, max_new_tokens=7)),
        cache.digest_of(queue, SampleRequest(messages=(("user", "E equals "),)), ON),
        # The key (each has its own entries) and the policy's version.
        cache.digest_of(queue, replace(hot, seed=3), ON, key_id=7),
        cache.digest_of(queue, replace(hot, seed=3), replace(ON, version=2)),
    }
    assert len(others | {seeded, greedy}) == len(others) + 2


def test_answers_are_shared_across_keys_only_when_the_policy_says_so() -> None:
    shared = replace(ON, response_cache_shared=True)
    assert cache.digest_of("q", "E equals ", ON, 1) != cache.digest_of("q", "E equals ", ON, 2)
    assert cache.digest_of("q", "E equals ", shared, 1) == cache.digest_of(
        "q", "E equals ", shared, 2
    )


def test_a_cached_answer_is_returned_by_the_append_and_joins_no_batch(
    redis_client: redis.Redis,
) -> None:
    aggregator = BatchAggregator(redis_client, unique_queue("cache"), shards=2)
    digest = cache.digest_of(aggregator.queue, "E equals ", ON)
    [miss] = aggregator.append_items([(digest, "E equals ")], 500, shard=0).tickets
    assert miss.cached is None
    assert miss.index == 0
    [item] = aggregator.seal(miss.batch_id).items
    assert item.cache == digest
    assert item.prompt == "E equals "
    answer = [ItemOutcome.OK, "MC squared"]
    with redis_client.pipeline() as pipe:
        aggregator.queue_cached_answers(pipe, {digest: json.dumps(answer)}, 60_000)
        pipe.execute()
    counter = aggregator.shards[1].requests_counter(9, 1)
    for shard in (0, 1):  # every shard has it
        joined = aggregator.append_items(
            [(digest, "E equals ")], 500, shard=shard, key_id=9, counter=AppendCounter(counter)
        )
        [hit] = joined.tickets
        assert hit.cached is not None
        assert json.loads(hit.cached) == answer
        assert hit.batch_id == ""
        assert aggregator.open_batch_id(shard) is None  # nothing joined a batch
    assert joined.counted == 2  # a hit is a request all the same: the rate counter counts it
    assert 0 < redis_client.pttl(aggregator.shards[0].cached(digest)) <= 60_000
    [other] = aggregator.append_items([("0" * 32, "E equals again ")], 500, shard=0).tickets
    assert other.cached is None
    assert aggregator.open_batch_id(0) == other.batch_id


def test_no_answer_of_a_version_older_than_the_workers_is_served(
    redis_client: redis.Redis,
) -> None:
    aggregator = BatchAggregator(redis_client, unique_queue("cache"))
    old = cache.digest_of(aggregator.queue, "E equals ", replace(ON, version=1))
    with redis_client.pipeline() as pipe:
        aggregator.queue_cached_answers(pipe, {old: json.dumps([ItemOutcome.OK, "old"])}, 60_000)
        aggregator.queue_cache_version(pipe, 1)
        pipe.execute()
    [hit] = aggregator.append_items([(old, "E equals ")], 500, shard=0, version=1).tickets
    assert hit.cached is not None
    # A worker's heartbeat says it runs version 2: a web process still at 1 gets no hit.
    with redis_client.pipeline() as pipe:
        aggregator.queue_cache_version(pipe, 2)
        pipe.execute()
    [miss] = aggregator.append_items([(old, "E equals ")], 500, shard=0, version=1).tickets
    assert miss.cached is None
    assert miss.batch_id


def test_a_worker_caches_under_the_digest_of_its_own_policy(redis_client: redis.Redis) -> None:
    aggregator = BatchAggregator(redis_client, unique_queue("cache"))
    runner = BatchRunner(aggregator, SimulatedSampler(), "w1")
    web_policy, worker_policy = replace(ON, version=1), replace(ON, version=2, max_new_tokens=9)
    web_digest = cache.digest_of(aggregator.queue, "E equals ", web_policy, 5)
    item = Item(0, "E equals ", key_id=5, cache=web_digest)
    answers = [Answer(ItemOutcome.OK, "MC squared")]
    stored = runner._cached_answers([item], answers, worker_policy)
    assert stored == {
        cache.digest_of(aggregator.queue, "E equals ", worker_policy, 5): answers[0].to_json()
    }
    assert web_digest not in stored
    assert runner._cached_answers([item], answers, Policy()) == {}  # its cache is off


class RefusingSampler(SimulatedSampler):
    """A sampler that refuses every new policy (say, max tokens above its context)."""

    def configure(self, generation: GenerationSettings) -> None:
        raise ValueError("max_new_tokens above the model's context")


def test_a_sampler_that_refused_the_policy_caches_under_what_it_ran(
    redis_client: redis.Redis,
) -> None:
    aggregator = BatchAggregator(redis_client, unique_queue("cache"))
    sampler = RefusingSampler()
    published = replace(ON, version=4, max_new_tokens=sampler.generation.max_new_tokens + 5)
    runner = BatchRunner(aggregator, sampler, "w1", policy=lambda: published)
    ticket = aggregator.append("E equals ", 500)
    turn = runner.begin(ticket.batch_id)
    assert turn is not None
    assert turn.ran is not None
    assert turn.ran.max_new_tokens == sampler.generation.max_new_tokens  # not the policy's
    # The worker keeps the policy it had, whole (workers.runner.apply_policy): its version.
    assert turn.ran.version == runner.applied.version != published.version
    assert cache.digest_of(aggregator.queue, "E equals ", turn.ran) != cache.digest_of(
        aggregator.queue, "E equals ", published
    )
