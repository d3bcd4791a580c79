"""The live stats page of a queue: /admin/stats/ (behind the admin's login)."""

from __future__ import annotations

from django.conf import settings
from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.safestring import mark_safe

from inference_site.redis_client import redis_client
from operations import dashboard
from operations.models import SamplingPolicy, Tier, default_policy, known_queues
from sampling.runtime import web_process


def stats_page(request: HttpRequest) -> HttpResponse:
    """The live stats page of one queue (?queue=, by default this node's SAMPLING_QUEUE)."""
    queue = request.GET.get("queue") or settings.SAMPLING_QUEUE
    row = SamplingPolicy.objects.filter(queue=queue).first()
    if queue == settings.SAMPLING_QUEUE:
        policy = web_process().watcher.current  # what this node's processes apply now
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
    }
    return TemplateResponse(request, "admin/sampling/stats.html", context)
