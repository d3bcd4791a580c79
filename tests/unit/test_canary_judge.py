"""Canary trials judged against Django's test database and a real Redis (operations.canary):
a worse canary rolled back by name, a trial started again when its target is set again, the
traffic counted only through its alias, and one unreadable trial stopping no other."""

from __future__ import annotations

import io

import pytest
import redis
from django.core.management import call_command

from batching.keys import QueueKeys
from operations import canary as judge
from operations.registry import AliasTarget, CanaryTrial, CatalogChange, RegisteredModel
from telemetry import canary, stats
from tests.support import unique_queue

pytestmark = pytest.mark.django_db

RULE = canary.Rule(min_clusters=6, min_requests=100)
NOW = 1_800_000_000.0  # a fixed clock: buckets written where the judge reads
LAST = int(NOW - judge.FLUSH_LAG_S) // 10 * 10 - 10


def split(base: str, can: str, weights: tuple[int, int] = (90, 10)) -> str:
    alias = unique_queue("alias")
    for model in (base, can):
        RegisteredModel.objects.get_or_create(name=model)
    call_command("setalias", alias, f"{base}={weights[0]}", f"{can}={weights[1]}:canary",
                 stdout=io.StringIO())  # fmt: skip
    return alias


def traffic(
    client: redis.Redis, model: str, via: str, ok: int, errors: int, clusters: int, end: int = LAST
) -> None:
    """`clusters` 10 s buckets up to `end` of a model's requests through `via`."""
    for start in range(end - 10 * (clusters - 1), end + 1, 10):
        key = QueueKeys(model).stats_bucket(stats.TEN_SECONDS, start)
        prefix = f"{stats.VIA_PREFIX}{via}:" if via else ""
        client.hset(key, mapping={f"{prefix}req:ok": ok, f"{prefix}req:error": errors})


def weight(alias: str, model: str) -> int:
    return AliasTarget.objects.get(alias__name=alias, model__name=model).weight


def test_a_worse_canary_is_rolled_back_with_its_figures(redis_client: redis.Redis) -> None:
    base, can = unique_queue("base"), unique_queue("can")
    alias = split(base, can)
    traffic(redis_client, base, alias, ok=90, errors=0, clusters=6)
    traffic(redis_client, can, alias, ok=12, errors=8, clusters=6)
    assert judge.judge_canaries(redis_client, RULE, NOW) == 1
    assert weight(alias, can) == 0
    change = CatalogChange.objects.get(details__kind=judge.ROLLBACK, details__alias=alias)
    errors = {r["measure"]: r for r in change.details["readings"]}[canary.ERRORS]
    assert errors["canary_rate"] == pytest.approx(0.4)
    assert errors["log_evidence"] >= change.details["threshold"]
    assert CanaryTrial.objects.get(alias=alias, model=can).rolled_back_s == NOW


def test_only_the_requests_through_its_alias_count(redis_client: redis.Redis) -> None:
    base, can = unique_queue("base"), unique_queue("can")
    alias = split(base, can)
    traffic(redis_client, base, alias, ok=90, errors=0, clusters=6)
    traffic(redis_client, can, alias, ok=20, errors=0, clusters=6)
    # Failures of requests naming the canary itself, or through another alias: not its trial's.
    traffic(redis_client, can, "", ok=0, errors=500, clusters=6, end=LAST)
    assert judge.judge_canaries(redis_client, RULE, NOW) == 0
    trial = CanaryTrial.objects.get(alias=alias, model=can)
    assert trial.state == canary.PAUSED  # for want of a live worker here: never worse
    assert {r["measure"]: r for r in trial.readings}[canary.ERRORS]["canary_rate"] == 0
    assert weight(alias, can) == 10


def test_a_rollback_finds_its_target_by_name_after_setalias_replaced_it(
    redis_client: redis.Redis,
) -> None:
    base, can = unique_queue("base"), unique_queue("can")
    alias = split(base, can)
    traffic(redis_client, base, alias, ok=90, errors=0, clusters=6)
    traffic(redis_client, can, alias, ok=12, errors=8, clusters=6)
    judged = AliasTarget.objects.select_related("alias", "model").get(
        alias__name=alias, model__name=can
    )
    row = CanaryTrial.objects.create(alias=alias, model=can, through_s=LAST, target_id=judged.pk)
    call_command("setalias", alias, f"{base}=80", f"{can}=20:canary", stdout=io.StringIO())
    assert judge._roll_back(judged, row, [base], RULE, NOW) == 1  # the row it read is gone
    assert weight(alias, can) == 0


def test_a_target_set_again_starts_a_new_trial(redis_client: redis.Redis) -> None:
    base, can = unique_queue("base"), unique_queue("can")
    alias = split(base, can)
    traffic(redis_client, base, alias, ok=90, errors=0, clusters=6)
    traffic(redis_client, can, alias, ok=20, errors=0, clusters=6)
    judge.judge_canaries(redis_client, RULE, NOW)
    before = CanaryTrial.objects.get(alias=alias, model=can)
    assert before.sums["canary"][canary.LATE]["requests"] == 120
    split_again = ("setalias", alias, f"{base}=50", f"{can}=50:canary")
    call_command(*split_again, stdout=io.StringIO())  # a new version, say
    judge.judge_canaries(redis_client, RULE, NOW + 10)
    after = CanaryTrial.objects.get(alias=alias, model=can)
    assert after.target_id != before.target_id
    assert after.sums["canary"][canary.LATE]["requests"] < 120  # the old history is gone


def test_an_unreadable_trial_starts_again_and_stops_no_other(redis_client: redis.Redis) -> None:
    base = unique_queue("base")
    first, second = unique_queue("can"), unique_queue("can")
    aliases = [split(base, first), split(base, second)]
    for alias, can in zip(aliases, (first, second), strict=True):
        traffic(redis_client, base, alias, ok=90, errors=0, clusters=6)
        traffic(redis_client, can, alias, ok=10, errors=10, clusters=6)
    target = AliasTarget.objects.get(alias__name=aliases[0], model__name=first)
    CanaryTrial.objects.create(alias=aliases[0], model=first, through_s=LAST - 60,
                               target_id=target.pk, sums={"canary": {"late": {}}})  # fmt: skip
    assert judge.judge_canaries(redis_client, RULE, NOW) == 2
