"""The feeder's question for a job's key (offline.standing.refusal_of), on a real Redis: a key
made after the feeder last read the keys is read again, not taken for a deleted one."""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any, cast

import redis

from accounts import access
from accounts.budgets import Budgets
from batching.keys import AccessKeys
from batching.problems import Problem
from offline.standing import refusal_of


def published(client: redis.Redis, scope: AccessKeys, key_ids: list[int]) -> None:
    records: dict[str, access.KeyRecord | access.Caller] = {
        access.digest_of(access.new_key()): access.KeyRecord(
            access.Caller(key_id, f"key {key_id}", "plus", 0, 0, 0)
        )
        for key_id in key_ids
    }
    access.replace_all(client, lambda: records, scope)


def test_a_key_made_since_the_last_read_is_read_again_and_a_deleted_one_refused(
    redis_client: redis.Redis,
) -> None:
    scope = AccessKeys(f"test-{uuid.uuid4().hex[:8]}")
    published(redis_client, scope, [1])
    watcher = access.AccessWatcher(redis_client, keys=scope)
    assert watcher.refresh()
    process = cast(Any, SimpleNamespace(access=watcher, budgets=Budgets(redis_client)))
    published(redis_client, scope, [1, 2])  # a new key and its job, before the next poll
    assert watcher.standing(2) == access.Refusal.UNKNOWN
    assert refusal_of(process, 2) is None
    published(redis_client, scope, [1])  # key 2 deleted, and the deletion read
    assert watcher.refresh()
    refused = refusal_of(process, 2)
    assert refused is not None
    assert refused.problem == Problem.UNAUTHORIZED
    assert refused.message == access.Refusal.UNKNOWN.value
