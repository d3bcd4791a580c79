"""Keys and tiers from the database to Redis: Django's test database and a real Redis. A
queryset's delete publishes (once per transaction), a lost set is republished unless intact,
housekeeping mends a set without its digest."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from batching import access
from inference_site import redis_client as web_redis
from operations import housekeeping
from operations.models import (
    ApiKey,
    Tier,
    access_records,
    publish_access,
    republish_missing_access,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def live_redis(settings: object, redis_url: str) -> Iterator[redis.Redis]:
    settings.REDIS_URL = redis_url  # type: ignore[attr-defined]
    web_redis.forget_clients()
    yield web_redis.redis_client()
    web_redis.forget_clients()


def _keys(tier: Tier, count: int) -> list[ApiKey]:
    """Saved, and published (the test's transaction never commits: published here)."""
    made = []
    for index in range(count):
        key = ApiKey(name=f"k{index}", tier=tier)
        key.issue()
        key.save()
        made.append(key)
    publish_access()
    return made


def _version(client: redis.Redis) -> int:
    return int(client.get(access.KEYS.version) or 0)


@pytest.mark.django_db(transaction=True)  # real commits: each runs its on_commit publish
def test_a_queryset_delete_publishes_once(live_redis: redis.Redis) -> None:
    tier = Tier.objects.create(name="bulk", priority=1)
    keys = _keys(tier, 3)
    assert {k.digest for k in keys} <= set(access.published(live_redis))
    before = _version(live_redis)
    ApiKey.objects.filter(pk__in=[k.pk for k in keys]).delete()  # "Delete selected"
    assert _version(live_redis) == before + 1  # one publish for the three rows
    assert not {k.digest for k in keys} & set(access.published(live_redis))
    assert access.intact(live_redis)


def test_a_lost_set_is_republished_from_the_database_unless_intact(
    live_redis: redis.Redis,
) -> None:
    tier = Tier.objects.create(name="lost", priority=1)
    [key] = _keys(tier, 1)
    version = _version(live_redis)
    republish_missing_access(live_redis)  # intact: nothing written
    assert _version(live_redis) == version
    live_redis.delete(access.KEYS.records, access.KEYS.version, access.KEYS.digest)
    republish_missing_access(live_redis)
    assert key.digest in access.published(live_redis)
    assert access.intact(live_redis)


def test_housekeeping_republishes_a_set_without_its_digest(live_redis: redis.Redis) -> None:
    """The database's records, written by a publisher that wrote no digest (an older
    version's, in a rolling upgrade): the watchers could not tell them intact."""
    Tier.objects.create(name="old", priority=1)
    wanted = {name: record.to_json() for name, record in access_records().items()}
    live_redis.delete(access.KEYS.records, access.KEYS.digest)
    live_redis.hset(access.KEYS.records, mapping=wanted)
    assert not access.intact(live_redis)
    housekeeping.reconcile_access(live_redis)
    assert access.intact(live_redis)
    assert access.published(live_redis) == wanted
