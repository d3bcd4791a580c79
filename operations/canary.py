"""Canary trials, judged by the service itself: every 5 to 10 s (a background job of the web
processes, one process at a time), each alias target marked as a canary that takes traffic
has its trial brought up to date, one 10 s cluster at a time, by telemetry.canary's sequential
test. A canary found worse is set to weight 0: the change is recorded in the registry's history
with the figures that decided it, and published like any registry change (every web process
stops sending it traffic within a second).

A trial starts when its canary is first judged, from the canary's traffic of the last
SAMPLING_CANARY_WINDOW_S; it restarts, counting only what comes after, when an operator gives
a rolled-back canary weight again. A canary with capacity
refusals in its last minute, or no live worker, is paused: its trial goes on, it is not rolled
back for them. A canary with a ramp (`AliasTarget.ramp_to`) doubles its weight each time its
trial has watched it for SAMPLING_CANARY_RAMP_EVERY_S; a pause holds the ramp.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict

import redis
from django.conf import settings
from django.db import close_old_connections, transaction
from django.utils import timezone

from batching.keys import CANARY_LOCK_KEY, QueueKeys
from batching.policy import Policy
from batching.registry import WorkerRegistry
from batching.topology import REDIS_FAULTS
from operations.registry import AliasTarget, CanaryTrial, CatalogChange, record_change
from telemetry import canary, stats

log = logging.getLogger(__name__)

# What marks a rollback, and a ramp's step, in the registry's history (details["kind"]).
ROLLBACK = "canary rollback"
RAMP = "canary ramp"
# One judgement per this long at most, whatever the processes and models: each process runs
# its background jobs every 10 s (serving.runtime), so a canary is judged every 5 to 10 s.
JUDGE_EVERY_MS = 5000
# A cluster is counted this long after it ends: every web process has flushed into it.
FLUSH_LAG_S = 3
# The most a trial catches up at one look: the 10 s buckets Redis keeps.
CATCH_UP_S = stats.TTL_S[stats.TEN_SECONDS] - 600
# A trial not judged for this long (its canary at weight 0, or unmarked) starts again.
STALE_AFTER_S = 600


def rule() -> canary.Rule:
    return canary.Rule(
        margin=settings.SAMPLING_CANARY_MARGIN_PERCENT / 100,
        false_rollback=settings.SAMPLING_CANARY_FALSE_ROLLBACK_PERCENT / 100,
        min_requests=settings.SAMPLING_CANARY_MIN_REQUESTS,
        min_clusters=settings.SAMPLING_CANARY_WINDOW_S // canary.CLUSTER_S,
    )


def run(client: redis.Redis, queue: str, current: Policy) -> None:
    """The background job (its signature: serving.runtime.BackgroundJob): the first process
    to take the lock in each interval judges every canary."""
    if not client.set(CANARY_LOCK_KEY, queue, nx=True, px=JUDGE_EVERY_MS):
        return
    try:
        judge_canaries(client, rule(), time.time())
    finally:
        close_old_connections()


def judge_canaries(client: redis.Redis, judged_by: canary.Rule, now_s: float) -> int:
    """Bring every canary's trial up to date and roll back those found worse; returns how
    many were."""
    rolled_back = 0
    last = int(now_s - FLUSH_LAG_S) // canary.CLUSTER_S * canary.CLUSTER_S - canary.CLUSTER_S
    canaries = AliasTarget.objects.filter(canary=True, weight__gt=0).select_related(
        "alias", "model"
    )
    for target in canaries:
        baseline = [
            other.model.name
            for other in target.alias.targets.select_related("model")
            if not other.canary and other.weight > 0
        ]
        if not baseline:
            continue  # nothing to compare with
        try:
            trial = _judged(client, target, baseline, last, judged_by)
            if trial is not None and trial.state == canary.WORSE:
                rolled_back += _roll_back(target, trial, baseline, judged_by, now_s)
            elif trial is not None and target.ramp_to > target.weight:
                _ramp(target, trial, now_s, judged_by)
        except REDIS_FAULTS:
            raise  # every canary's alike: the background job logs it once
        except Exception:  # one canary's failure must not stop the judging of the others
            log.exception("canary %s of alias %s not judged", target.model, target.alias)
    return rolled_back


def _ramp(target: AliasTarget, trial: CanaryTrial, now_s: float, judged_by: canary.Rule) -> None:
    """A canary with a ramp: its weight doubled (up to `ramp_to`) once its trial has watched
    it for SAMPLING_CANARY_RAMP_EVERY_S; any other state (too early, paused) holds the step's
    clock, which starts again after it."""
    if trial.state != canary.WATCHING or not trial.ramp_since:
        CanaryTrial.objects.filter(pk=trial.pk).update(ramp_since=now_s)
        return
    if now_s - trial.ramp_since < settings.SAMPLING_CANARY_RAMP_EVERY_S:
        return
    weight = min(target.ramp_to, max(1, target.weight) * 2)
    figures = canary.summary(_trial_of(trial), judged_by)
    with transaction.atomic():
        # Only from the weight judged (an operator may have changed it meanwhile).
        if not AliasTarget.objects.filter(pk=target.pk, weight=target.weight).update(weight=weight):
            return
        CanaryTrial.objects.filter(pk=trial.pk).update(ramp_since=now_s)
        record_change(
            f"ramped canary {target.model.name} of alias {target.alias.name} from "
            f"{target.weight} to {weight}: {figures}",
            kind=RAMP,
            alias=target.alias.name,
            model=target.model.name,
            weight_was=target.weight,
            weight=weight,
            readings=trial.readings,
        )


def _judged(
    client: redis.Redis,
    target: AliasTarget,
    baseline: list[str],
    last: int,
    judged_by: canary.Rule,
) -> CanaryTrial | None:
    """The target's trial brought up to the cluster starting at `last`; None when another
    process counted the same clusters first."""
    # A new trial counts the canary's last stretch of traffic at once; a restart, only after.
    row, _ = CanaryTrial.objects.get_or_create(
        alias=target.alias.name,
        model=target.model.name,
        defaults={
            "through_s": last - judged_by.min_clusters * canary.CLUSTER_S,
            "target_id": target.pk,
        },
    )
    if row.target_id != target.pk or row.rolled_back_s or last - row.through_s > STALE_AFTER_S:
        # The target set again (setalias), given weight after its rollback, or not judged
        # for a while: a new trial, from now.
        CanaryTrial.objects.filter(pk=row.pk).update(
            target_id=target.pk, through_s=last, state=canary.TOO_EARLY, sums={}, readings=[],
            ramp_since=0.0, rolled_back_s=0.0, started=timezone.now(),
        )  # fmt: skip
        row.refresh_from_db()
    first = max(row.through_s + canary.CLUSTER_S, last - CATCH_UP_S)
    trial = _trial_of(row)
    ours = canary.clusters_of(client, [row.model], first, last, via=row.alias)
    theirs = canary.clusters_of(client, baseline, first, last, via=row.alias)
    for mine, other in zip(ours, theirs, strict=True):
        trial = trial.plus(mine, other)
    state = trial.state(judged_by)
    if state != canary.WORSE and not WorkerRegistry(client, QueueKeys(row.model)).live_count():
        state = canary.PAUSED  # no live worker: failover sends its users elsewhere
    readings = [reading.as_json() for reading in trial.readings(judged_by)]
    counted = CanaryTrial.objects.filter(pk=row.pk, through_s=row.through_s).update(
        through_s=max(last, row.through_s), state=state, sums=trial.to_json(), readings=readings
    )
    if not counted:
        return None
    row.state, row.sums, row.readings = state, trial.to_json(), readings
    return row


def _trial_of(row: CanaryTrial) -> canary.Trial:
    """A row's trial; a fresh one where its sums do not read (a hand edit, another version)."""
    try:
        return canary.Trial.from_json(row.sums)
    except (KeyError, TypeError, ValueError) as exc:
        log.error("canary trial of %s in %s unreadable (%r): started again", row.model, row.alias,
                  exc)  # fmt: skip
        return canary.Trial()


def _roll_back(
    target: AliasTarget,
    trial: CanaryTrial,
    baseline: list[str],
    judged_by: canary.Rule,
    now_s: float,
) -> int:
    figures = canary.summary(_trial_of(trial), judged_by)
    with transaction.atomic():
        # By name (setalias replaces target rows), and only if it still takes traffic.
        taking = AliasTarget.objects.filter(
            alias__name=target.alias.name, model__name=target.model.name, canary=True,
            weight__gt=0,
        )  # fmt: skip
        if not taking.update(weight=0):
            return 0
        CanaryTrial.objects.filter(pk=trial.pk).update(rolled_back_s=now_s)
        record_change(
            f"rolled back canary {target.model.name} of alias {target.alias.name}: {figures}",
            kind=ROLLBACK,
            alias=target.alias.name,
            model=target.model.name,
            weight_was=target.weight,
            readings=trial.readings,
            baseline=baseline,
            threshold=round(judged_by.threshold, 2),
            rule=asdict(judged_by),
            trial_started=trial.started.isoformat(),
        )
    log.warning(
        "canary %s of alias %s rolled back to weight 0: %s",
        target.model.name, target.alias.name, figures,
    )  # fmt: skip
    return 1


def recent_rollbacks(limit: int = 5) -> list[CatalogChange]:
    return list(CatalogChange.objects.filter(details__kind=ROLLBACK).order_by("-id")[:limit])
