"""Keys and tiers from the database to Redis: Django's test database and a real Redis. A
queryset's delete publishes (once per transaction), a lost set is republished unless intact,
housekeeping mends a set without its digest."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import asdict

import pytest
import redis
from django.core.management import CommandError, call_command

from accounts import access
from accounts.budgets import budget_nanos
from operations import housekeeping
from operations.models import (
    ApiKey,
    OwnerBudget,
    Tier,
    access_records,
    publish_access,
    republish_missing_access,
)
from serving import redis_client as web_redis

pytestmark = pytest.mark.django_db


@pytest.fixture
def live_redis(settings: object, redis_url: str) -> Iterator[redis.Redis]:
    # The web client reads SAMPLING_REDIS_URL: without it the test used whatever served 6379.
    settings.REDIS_URL = settings.SAMPLING_REDIS_URL = redis_url  # type: ignore[attr-defined]
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


@pytest.mark.django_db(transaction=True)
def test_an_owner_s_budget_is_published_with_each_of_its_keys(live_redis: redis.Redis) -> None:
    tier = Tier.objects.create(name="owned", priority=1)
    keys = _keys(tier, 3)
    for key in keys[:2]:
        key.owner = "acme"
        key.save()
    call_command("setownerbudget", "acme", "2.5", stdout=io.StringIO())

    def published_callers() -> dict[int, access.Caller]:
        found = access.published(live_redis)
        return {k.pk: access.KeyRecord.from_json(found[k.digest]).caller for k in keys}

    callers = published_callers()
    assert [callers[k.pk].owner for k in keys] == ["acme", "acme", ""]
    # A key without an owner's budget publishes no field an older web process cannot read.
    owners_fields = {"owner", "owner_budget_nanos"}
    assert not owners_fields & set(json.loads(access.published(live_redis)[keys[2].digest]))
    budget = budget_nanos(OwnerBudget.objects.get(owner="acme").monthly_budget)
    assert [callers[k.pk].owner_budget_nanos for k in keys] == [budget, budget, 0]
    watcher = access.AccessWatcher(live_redis)
    watcher.refresh()
    assert watcher.owners_keys == {"acme": frozenset(k.pk for k in keys[:2])}
    call_command("setownerbudget", "acme", "none", stdout=io.StringIO())
    assert [c.owner_budget_nanos for c in published_callers().values()] == [0, 0, 0]
    assert not any(
        owners_fields & set(json.loads(raw)) for raw in access.published(live_redis).values()
    )
    with pytest.raises(CommandError):
        call_command("setownerbudget", "acme", "-1", stdout=io.StringIO())


def test_housekeeping_leaves_another_version_s_wording_of_the_same_records(
    live_redis: redis.Redis,
) -> None:
    """An older version writes every field, defaults included: in a rolling upgrade both
    versions' housekeeping must not republish each other's records in turn."""
    tier = Tier.objects.create(name="worded", priority=1)
    _keys(tier, 2)

    def older_wording(record: access.KeyRecord | access.Caller) -> str:
        caller = record.caller if isinstance(record, access.KeyRecord) else record
        fields = {k: v for k, v in asdict(caller).items() if not k.startswith("owner")}
        if isinstance(record, access.KeyRecord):
            fields |= {"expires_at": record.expires_at, "revoked": record.revoked}
        return json.dumps(fields)

    older = {name: older_wording(record) for name, record in access_records().items()}
    assert older != {name: record.to_json() for name, record in access_records().items()}
    live_redis.delete(access.KEYS.records)
    live_redis.hset(access.KEYS.records, mapping=older)
    live_redis.set(access.KEYS.digest, access.digest_of_records(older))
    before = _version(live_redis)
    housekeeping.reconcile_access(live_redis)
    assert (_version(live_redis), access.published(live_redis)) == (before, older)
    # A change the database has and Redis lacks (an update() sends no signal) is published.
    Tier.objects.filter(pk=tier.pk).update(priority=5)
    housekeeping.reconcile_access(live_redis)
    assert _version(live_redis) > before
    wanted = {name: record.to_json() for name, record in access_records().items()}
    assert access.published(live_redis) == wanted
