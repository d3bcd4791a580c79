"""API keys as a web process sees them: published records, polled, checked in memory."""

from __future__ import annotations

import time
import uuid

import pytest
import redis

from accounts import access
from batching.keys import AccessKeys


@pytest.fixture
def scope() -> AccessKeys:
    return AccessKeys(f"test-{uuid.uuid4().hex[:8]}")


def _record(key_id: int, tier: str = "plus", **kwargs: object) -> access.KeyRecord:
    caller = access.Caller(key_id, f"key {key_id}", tier, 20, 60, 1000)
    return access.KeyRecord(caller, **kwargs)  # type: ignore[arg-type]


def test_keys_are_random_and_kept_as_digests() -> None:
    first, second = access.new_key(), access.new_key()
    assert first != second
    assert first.startswith(access.KEY_PREFIX)
    assert len(access.digest_of(first)) == 64
    assert access.digest_of(first) != first
    assert first.startswith(access.visible_prefix(first))
    assert len(access.visible_prefix(first)) < len(first) // 3


def test_watcher_identifies_published_keys(redis_client: redis.Redis, scope: AccessKeys) -> None:
    good, revoked, expired = access.new_key(), access.new_key(), access.new_key()
    records: dict[str, access.KeyRecord | access.Caller] = {
        access.digest_of(good): _record(1),
        access.digest_of(revoked): _record(2, revoked=True),
        access.digest_of(expired): _record(3, expires_at=time.time() - 1),
        access.tier_field(access.ANONYMOUS_TIER): access.anonymous_caller(priority=5, rpm=7),
    }
    access.replace_all(redis_client, lambda: records, scope)
    watcher = access.AccessWatcher(redis_client, keys=scope)
    assert watcher.refresh()
    assert not watcher.refresh()  # nothing moved: only the version was read
    assert watcher.identify(f"Bearer {good}", required=True) == _record(1).caller
    # Scheme in any case, spaces around the key: the same caller (a refusal is not one).
    assert watcher.identify(f"bearer  {good} ", required=True) == _record(1).caller
    for required in (True, False):
        assert watcher.identify(f"Bearer {revoked}", required) == access.Refusal.REVOKED
        assert watcher.identify(f"Bearer {expired}", required) == access.Refusal.EXPIRED
    assert watcher.identify(None, required=True) == access.Refusal.MISSING
    assert watcher.identify("Basic abc", required=True) == access.Refusal.MALFORMED
    assert watcher.identify(f"Bearer {access.new_key()}", required=True) == access.Refusal.UNKNOWN
    # Not required: no key, a foreign scheme or an unknown key is the anonymous tier's.
    anonymous = watcher.identify(None, required=False)
    assert anonymous == access.anonymous_caller(priority=5, rpm=7)
    assert watcher.identify("Bearer EMPTY", required=False) == anonymous


def test_changes_are_seen_after_the_version_moves(
    redis_client: redis.Redis, scope: AccessKeys
) -> None:
    key = access.new_key()
    access.replace_all(redis_client, lambda: {access.digest_of(key): _record(1)}, scope)
    watcher = access.AccessWatcher(redis_client, keys=scope)
    watcher.refresh()
    assert isinstance(watcher.identify(f"Bearer {key}", required=True), access.Caller)
    access.replace_all(
        redis_client, lambda: {access.digest_of(key): _record(1, revoked=True)}, scope
    )
    assert watcher.refresh()
    assert watcher.identify(f"Bearer {key}", required=True) == access.Refusal.REVOKED
    access.replace_all(redis_client, dict, scope)
    watcher.refresh()
    assert watcher.identify(f"Bearer {key}", required=True) == access.Refusal.UNKNOWN


def test_never_loaded_means_unavailable_only_when_a_key_must_be_checked(
    scope: AccessKeys,
) -> None:
    dead = redis.Redis(port=1, socket_connect_timeout=0.2)
    watcher = access.AccessWatcher(dead, keys=scope)
    with pytest.raises(redis.RedisError):
        watcher.refresh()
    assert watcher.identify(f"Bearer {access.new_key()}", required=True) is None
    assert watcher.identify(None, required=False) == access.anonymous_caller()


def test_last_use_is_flushed_by_key_id(redis_client: redis.Redis, scope: AccessKeys) -> None:
    key = access.new_key()
    access.replace_all(redis_client, lambda: {access.digest_of(key): _record(42)}, scope)
    watcher = access.AccessWatcher(redis_client, keys=scope)
    watcher.refresh()
    before = time.time()
    watcher.identify(f"Bearer {key}", required=True)
    watcher.flush_last_used()
    seen = access.last_used(redis_client, scope)
    assert set(seen) == {42}
    assert seen[42] >= int(before)


def test_a_publisher_with_a_stale_snapshot_reads_again(
    redis_client: redis.Redis, scope: AccessKeys
) -> None:
    """Two saves racing: the one whose snapshot predates the other's publish reads again."""
    first, second = access.new_key(), access.new_key()
    database = {access.digest_of(first): _record(1)}
    reads = 0

    def snapshot() -> dict[str, access.KeyRecord | access.Caller]:
        nonlocal reads
        reads += 1
        taken: dict[str, access.KeyRecord | access.Caller] = dict(database)
        if reads == 1:  # another save commits and publishes while this one is between steps
            database[access.digest_of(second)] = _record(2)
            assert access.replace_all(redis_client, lambda: dict(database), scope)
        return taken

    assert access.replace_all(redis_client, snapshot, scope)
    assert reads == 2
    assert set(access.published(redis_client, scope)) == set(database)


def _lose_everything(client: redis.Redis, scope: AccessKeys) -> None:
    """What a Redis restarted with no data has of the scope: nothing."""
    client.delete(scope.records, scope.version, scope.digest)


def test_a_restarted_counter_cannot_hide_a_change(
    redis_client: redis.Redis, scope: AccessKeys
) -> None:
    """Redis restarts empty and the set is republished with another key: the counter is back
    at the value this process last saw, the digest is not."""
    old, new = access.new_key(), access.new_key()
    access.replace_all(redis_client, lambda: {access.digest_of(old): _record(1)}, scope)
    watcher = access.AccessWatcher(redis_client, keys=scope)
    assert watcher.refresh()
    seen_version = redis_client.get(scope.version)
    _lose_everything(redis_client, scope)
    access.replace_all(redis_client, lambda: {access.digest_of(new): _record(2)}, scope)
    assert redis_client.get(scope.version) == seen_version  # the counter's coincidence
    assert watcher.refresh()
    assert watcher.identify(f"Bearer {new}", required=True) == _record(2).caller
    assert watcher.identify(f"Bearer {old}", required=True) == access.Refusal.UNKNOWN


def test_a_lost_set_is_kept_and_republished_at_once(
    redis_client: redis.Redis, scope: AccessKeys
) -> None:
    """Redis loses the set: the very poll that notices keeps the last good set in use and
    republishes the database's, which it then reads."""
    key, added = access.new_key(), access.new_key()
    database: dict[str, access.KeyRecord | access.Caller] = {access.digest_of(key): _record(1)}
    republished = 0

    def republish() -> None:
        nonlocal republished
        republished += 1
        access.replace_all(redis_client, lambda: dict(database), scope, unless_intact=True)

    access.replace_all(redis_client, lambda: dict(database), scope)
    watcher = access.AccessWatcher(redis_client, keys=scope, republish=republish)
    assert watcher.refresh()
    assert republished == 0
    _lose_everything(redis_client, scope)
    database[access.digest_of(added)] = _record(2)  # saved while Redis could not take it
    assert watcher.refresh()  # noticed, republished and read again in one poll
    assert republished == 1
    assert set(access.published(redis_client, scope)) == set(database)
    assert watcher.identify(f"Bearer {key}", required=True) == _record(1).caller
    assert watcher.identify(f"Bearer {added}", required=True) == _record(2).caller
    assert watcher.missing_since is None
    assert not watcher.refresh()


def test_without_a_republisher_the_last_good_set_stays(
    redis_client: redis.Redis, scope: AccessKeys
) -> None:
    key = access.new_key()
    anonymous = access.anonymous_caller(priority=3)
    records: dict[str, access.KeyRecord | access.Caller] = {
        access.digest_of(key): _record(1),
        access.tier_field(access.ANONYMOUS_TIER): anonymous,
    }
    access.replace_all(redis_client, lambda: records, scope)
    watcher = access.AccessWatcher(redis_client, keys=scope)
    watcher.refresh()
    _lose_everything(redis_client, scope)
    for _ in range(3):
        assert not watcher.refresh()
        # Keys required: the key still works; not required: still its own tier, not anonymous.
        for required in (True, False):
            assert watcher.identify(f"Bearer {key}", required) == _record(1).caller
        assert watcher.identify(None, required=False) == anonymous
    assert watcher.missing_since is not None
    access.replace_all(redis_client, lambda: records, scope)
    watcher.refresh()  # the same records: nothing to read again
    assert watcher.missing_since is None


def test_a_set_that_does_not_match_its_digest_is_not_applied(
    redis_client: redis.Redis, scope: AccessKeys
) -> None:
    """Records lost while the digest stayed (or written by a publisher that writes none): the
    set is broken, the last good one stays, and a republish unless intact mends it."""
    key = access.new_key()
    records = {access.digest_of(key): _record(1)}
    access.replace_all(redis_client, lambda: records, scope)
    watcher = access.AccessWatcher(redis_client, keys=scope)
    watcher.refresh()
    redis_client.delete(scope.records)
    redis_client.incr(scope.version)
    assert not access.intact(redis_client, scope)
    assert not watcher.refresh()
    assert watcher.identify(f"Bearer {key}", required=True) == _record(1).caller
    assert access.replace_all(redis_client, lambda: records, scope, unless_intact=True)
    assert access.intact(redis_client, scope)
    assert watcher.refresh()


def test_republishing_unless_intact_leaves_an_intact_set_alone(
    redis_client: redis.Redis, scope: AccessKeys
) -> None:
    """Many processes notice the loss at once: after the first republish, the others read
    the database no more and write nothing."""
    reads = 0

    def snapshot() -> dict[str, access.KeyRecord | access.Caller]:
        nonlocal reads
        reads += 1
        return {access.digest_of("sk-x"): _record(1)}

    assert access.replace_all(redis_client, snapshot, scope, unless_intact=True)
    version = redis_client.get(scope.version)
    for _ in range(3):
        assert access.replace_all(redis_client, snapshot, scope, unless_intact=True)
    assert reads == 1
    assert redis_client.get(scope.version) == version
