"""The live policy: validation, publishing with versions, and the per-process watcher, on a
real Redis."""

from __future__ import annotations

import pytest
import redis

from batching.keys import QueueKeys
from batching.policy import Policy, PolicyWatcher, publish, withdraw
from tests.support import unique_queue
from tests.support.waiting import wait_until


def test_defaults_are_valid_and_bounds_are_named() -> None:
    assert Policy().problems() == []
    problems = Policy(max_batch_size=101, deadline_ms=0, top_p=0.0).problems()
    assert any(p.startswith("max_batch_size must be between 1 and 100, got 101") for p in problems)
    assert any(p.startswith("deadline_ms must be between 1") for p in problems)
    assert "top_p must be above 0, got 0" in problems


def test_json_round_trip_and_changes() -> None:
    policy = Policy(max_batch_size=7, stop="\n", temperature=0.7, version=3)
    assert Policy.from_json(policy.to_json()) == policy
    assert Policy(max_batch_size=5).changes_from(Policy()) == {"max_batch_size": (100, 5)}
    with pytest.raises(ValueError, match="max_batch_size"):
        Policy.from_json('{"max_batch_size": 500}')


def test_publish_never_replaces_a_newer_version(redis_client: redis.Redis) -> None:
    queue = unique_queue("pol")
    assert publish(redis_client, queue, Policy(max_batch_size=9, version=2))
    # A process republishing a version it read before the save must not undo the save.
    assert not publish(redis_client, queue, Policy(max_batch_size=4, version=1))
    assert Policy.from_json(redis_client.get(QueueKeys(queue).policy)).max_batch_size == 9
    assert publish(redis_client, queue, Policy(max_batch_size=3, version=3))
    with pytest.raises(ValueError, match="max_batch_size must be between"):
        publish(redis_client, queue, Policy(max_batch_size=0, version=4))


def test_watcher_follows_publish_and_withdraw(redis_client: redis.Redis) -> None:
    queue = unique_queue("pol")
    defaults = Policy(deadline_ms=700)
    watcher = PolicyWatcher(redis_client, queue, defaults, interval_s=0.05)
    seen: list[int] = []
    watcher.on_change(lambda p: seen.append(p.max_batch_size))
    assert watcher.refresh() is False
    assert watcher.current is defaults

    watcher.start()
    try:
        publish(redis_client, queue, Policy(max_batch_size=5, version=1))
        wait_until(lambda: watcher.current.version == 1, 2, "the published policy applied")
        assert watcher.current.max_batch_size == 5
        withdraw(redis_client, queue)
        wait_until(lambda: watcher.current is defaults, 2, "the defaults back")
    finally:
        watcher.stop()
    assert seen == [100, 5, 100]


def test_watcher_keeps_the_last_good_policy_on_a_bad_value(redis_client: redis.Redis) -> None:
    queue = unique_queue("pol")
    watcher = PolicyWatcher(redis_client, queue, Policy())
    publish(redis_client, queue, Policy(max_batch_size=8, version=1))
    assert watcher.refresh()
    redis_client.set(QueueKeys(queue).policy, '{"max_batch_size": 0, "version": 2}')
    assert not watcher.refresh()
    assert watcher.current.max_batch_size == 8
