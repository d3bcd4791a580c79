"""Rolling a canary back by itself: every 5 to 10 s (a background job of the web processes,
one process at a time), each alias target marked as a canary that takes traffic is compared
with its alias's other targets by batching.canary's rule; a worse one is set to weight 0,
the change recorded in the registry's history with the figures that decided it and
published like any registry change (every web process stops sending it traffic within a
second).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict

import redis
from django.conf import settings
from django.db import close_old_connections, transaction

from batching import canary
from batching.keys import CANARY_LOCK_KEY
from batching.policy import Policy
from operations.registry import AliasTarget, CatalogChange, record_change

log = logging.getLogger(__name__)

# What marks a rollback in the registry's history (CatalogChange.details["kind"]).
ROLLBACK = "canary rollback"
# One judgement per this long at most, whatever the processes and models: each process runs
# its background jobs every 10 s (sampling.runtime), so a canary is judged every 5 to 10 s.
JUDGE_EVERY_MS = 5000


def rule() -> canary.Rule:
    return canary.Rule(
        window_s=settings.SAMPLING_CANARY_WINDOW_S,
        min_requests=settings.SAMPLING_CANARY_MIN_REQUESTS,
        margin=settings.SAMPLING_CANARY_MARGIN_PERCENT / 100,
    )


def run(client: redis.Redis, queue: str, current: Policy) -> None:
    """The background job (its signature: sampling.runtime.BackgroundJob): the first process
    to take the lock in each interval judges every canary."""
    if not client.set(CANARY_LOCK_KEY, queue, nx=True, px=JUDGE_EVERY_MS):
        return
    try:
        judge_canaries(client, rule(), time.time())
    finally:
        close_old_connections()


def judge_canaries(client: redis.Redis, judged_by: canary.Rule, now_s: float) -> int:
    """Roll back every canary worse than its baseline; returns how many were."""
    rolled_back = 0
    canaries = AliasTarget.objects.filter(canary=True, weight__gt=0).select_related(
        "alias", "model"
    )
    for target in canaries:
        baseline_models = [
            other.model.name
            for other in target.alias.targets.select_related("model")
            if not other.canary and other.weight > 0
        ]
        if not baseline_models:
            continue  # nothing to compare with
        window = judged_by.window_s
        arm = canary.arm_of(client, target.model.name, window, now_s)
        baseline = sum(
            (canary.arm_of(client, name, window, now_s) for name in baseline_models), canary.Arm()
        )
        found = canary.verdict(arm, baseline, judged_by)
        if found is not None and _roll_back(target, found, baseline_models, judged_by):
            rolled_back += 1
    return rolled_back


def _roll_back(
    target: AliasTarget, found: canary.Verdict, baseline: list[str], judged_by: canary.Rule
) -> bool:
    with transaction.atomic():
        # Only if still taking traffic (an operator may have changed it meanwhile).
        if not AliasTarget.objects.filter(pk=target.pk, weight__gt=0).update(weight=0):
            return False
        record_change(
            f"rolled back canary {target.model.name} of alias {target.alias.name}: "
            f"{found.summary()}",
            kind=ROLLBACK,
            alias=target.alias.name,
            model=target.model.name,
            weight_was=target.weight,
            measure=found.measure,
            canary=found.canary.as_json(),
            baseline={"models": baseline, **found.baseline.as_json()},
            z=round(found.z, 2),
            rule=asdict(judged_by),
        )
    log.warning(
        "canary %s of alias %s rolled back to weight 0: %s",
        target.model.name, target.alias.name, found.summary(),
    )  # fmt: skip
    return True


def recent_rollbacks(limit: int = 5) -> list[CatalogChange]:
    return list(CatalogChange.objects.filter(details__kind=ROLLBACK).order_by("-id")[:limit])
