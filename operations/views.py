"""The live stats page of a queue: /admin/stats/ (behind the admin's login)."""

from __future__ import annotations

from django.conf import settings
from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.safestring import mark_safe

from operations import canary, dashboard
from operations.models import SamplingPolicy, Tier, default_policy, known_queues
from operations.registry import AliasTarget, CanaryTrial
from serving.redis_client import redis_client
from serving.runtime import web_process


def canary_targets() -> list[AliasTarget]:
    """Every alias target marked as a canary, with its alias's split (for the stats page)."""
    targets = list(AliasTarget.objects.filter(canary=True).select_related("alias", "model"))
    trials = {(t.alias, t.model): t for t in CanaryTrial.objects.all()}
    for target in targets:
        target.split = ", ".join(  # type: ignore[attr-defined]
            f"{t.model.name} {t.weight}" for t in target.alias.targets.select_related("model")
        )
        target.trial = trials.get((target.alias.name, target.model.name))  # type: ignore[attr-defined]
    return targets


def stats_page(request: HttpRequest) -> HttpResponse:
    """The live stats page of one model's queue (?queue=, by default this node's default
    model), and the canaries of every alias."""
    queue = request.GET.get("queue") or settings.SAMPLING_QUEUE
    row = SamplingPolicy.objects.filter(queue=queue).first()
    process = web_process()
    if queue in process.catalog.current.models:
        policy = process.model(queue).watcher.current  # what this node's processes apply now
    else:
        policy = row.as_policy() if row else default_policy()
    tiers = Tier.objects.values_list("name", flat=True)  # highest priority first
    board = dashboard.build(
        redis_client(),
        queue,
        policy,
        tier_order=list(tiers),
        saved_version=row.version if row else None,  # what the workers should run
    )
    context = {
        **admin.site.each_context(request),
        "title": f"Live statistics of queue {queue}",
        "board": board,
        # Built from numbers, every text escaped (operations.charts).
        "charts": [mark_safe(svg) for svg in board.charts],  # noqa: S308
        "queues": known_queues(),
        "refresh_s": 5,
        "retention_days": settings.SAMPLING_STATS_RETENTION_DAYS,
        "canaries": canary_targets(),
        "rollbacks": canary.recent_rollbacks(),
        "canary_rule": canary.rule(),
        "canary_margin_percent": f"{settings.SAMPLING_CANARY_MARGIN_PERCENT:g}",
        "canary_false_percent": f"{settings.SAMPLING_CANARY_FALSE_ROLLBACK_PERCENT:g}",
    }
    return TemplateResponse(request, "admin/sampling/stats.html", context)
