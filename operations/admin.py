"""The operators' admin: the policy of each queue, its audit log, per-minute statistics. The
live stats page (/admin/stats/, linked from the admin index) is operations.views."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib import admin, messages
from django.db import transaction
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from accounts import access
from batching import catalog
from batching.outcomes import RequestOutcome
from batching.policy import POLL_INTERVAL_S
from operations import usage
from operations.models import (
    ApiKey,
    OwnerBudget,
    PolicyChange,
    SamplingPolicy,
    StatsMinute,
    Tier,
    UsageMinute,
)
from operations.registry import AliasTarget, CatalogChange, ModelAlias, RegisteredModel

# The admin's usage sums on a key's and a tier's page cover this many days.
USAGE_DAYS = 30
# A saved key or tier reaches every web process within this long (a poll and a read).
PROPAGATION_S = access.POLL_INTERVAL_S * 2


@admin.register(SamplingPolicy)
class SamplingPolicyAdmin(admin.ModelAdmin[SamplingPolicy]):
    list_display = (
        "queue", "max_batch_size", "deadline_ms", "max_prompt_bytes", "max_new_tokens",
        "temperature", "top_p", "fill_target_percent", "version", "updated_at", "updated_by",
    )  # fmt: skip
    readonly_fields = ("version", "updated_at", "updated_by", "recent_changes")
    fieldsets = (
        (None, {"fields": ("queue",)}),
        ("Batching", {"fields": ("max_batch_size", "deadline_ms", "max_prompt_bytes")}),
        ("Generation", {"fields": ("max_new_tokens", "temperature", "top_p", "stop")}),
        (
            "Response cache",
            {"fields": ("response_cache", "response_cache_ttl_s", "response_cache_shared")},
        ),
        ("Capacity planning", {"fields": ("fill_target_percent",)}),
        ("Audit", {"fields": ("version", "updated_at", "updated_by", "recent_changes")}),
    )

    def save_model(
        self, request: HttpRequest, obj: SamplingPolicy, form: Any, change: bool
    ) -> None:
        obj.save(changed_by=request.user.get_username())
        self.message_user(
            request,
            f"Policy version {obj.version} of queue {obj.queue} saved; every web process and "
            f"worker applies it within {POLL_INTERVAL_S:g} s.",
            messages.SUCCESS,
        )

    def delete_model(self, request: HttpRequest, obj: SamplingPolicy) -> None:
        obj.delete(changed_by=request.user.get_username())

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[SamplingPolicy]) -> None:
        for obj in queryset:  # one audited delete each, never a bulk delete
            obj.delete(changed_by=request.user.get_username())

    @admin.display(description="recent changes")
    def recent_changes(self, obj: SamplingPolicy) -> str:
        changes = PolicyChange.objects.filter(queue=obj.queue)[:10]
        if not changes:
            return "-"
        return format_html(
            "<table><tr><th>when</th><th>who</th><th>version</th><th>changes</th></tr>{}</table>",
            format_html_join(
                "",
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                (
                    (f"{c.changed_at:%Y-%m-%d %H:%M:%S}", c.changed_by, c.version, c.summary())
                    for c in changes
                ),
            ),
        )


@admin.register(Tier)
class TierAdmin(admin.ModelAdmin[Tier]):
    list_display = ("name", "priority", "rpm", "tpm", "keys")
    readonly_fields = ("recent_usage",)

    @admin.display(description="keys")
    def keys(self, obj: Tier) -> int:
        return obj.keys.count()

    @admin.display(description=f"usage, last {USAGE_DAYS} days")
    def recent_usage(self, obj: Tier) -> str:
        if obj.pk is None:
            return "-"
        rows = _recent(UsageMinute.objects.filter(tier=obj.name))
        return _usage_table(usage.totals(rows, "key"), f"?tier={obj.name}")


@admin.register(OwnerBudget)
class OwnerBudgetAdmin(admin.ModelAdmin[OwnerBudget]):
    list_display = ("owner", "monthly_budget", "keys")
    search_fields = ("owner",)

    @admin.display(description="keys")
    def keys(self, obj: OwnerBudget) -> int:
        return ApiKey.objects.filter(owner=obj.owner).count()


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin[ApiKey]):
    list_display = (
        "name", "prefix", "owner", "tier", "rpm", "tpm", "monthly_budget", "created", "expires",
        "revoked", "last_used",
    )  # fmt: skip
    list_filter = ("tier", "revoked")
    search_fields = ("name", "owner", "prefix")
    readonly_fields = ("prefix", "created", "last_used", "recent_usage")
    actions = ("revoke",)

    @admin.display(description=f"usage, last {USAGE_DAYS} days")
    def recent_usage(self, obj: ApiKey) -> str:
        if obj.pk is None:
            return "-"
        rows = _recent(UsageMinute.objects.filter(key=obj))
        return _usage_table(usage.totals(rows, "queue"), f"?key__id__exact={obj.pk}")

    def save_model(self, request: HttpRequest, obj: ApiKey, form: Any, change: bool) -> None:
        if not obj.digest:
            obj.issued_key = obj.issue()  # shown by response_add, kept nowhere
        obj.save()
        if change:
            self.message_user(
                request,
                f"API key {obj.name!r} saved; every web process applies it within "
                f"{PROPAGATION_S:g} s.",
                messages.SUCCESS,
            )

    def response_add(
        self, request: HttpRequest, obj: ApiKey, post_url_continue: str | None = None
    ) -> HttpResponse:
        """The new key, shown once in the body of the response that created it: never in a
        message (Django keeps those in a cookie or the session), never on a later page."""
        if obj.issued_key is None:
            return super().response_add(request, obj, post_url_continue)
        context = {
            **self.admin_site.each_context(request),
            "title": "API key created",
            "opts": self.opts,
            "key_object": obj,
            "raw_key": obj.issued_key,
            "propagation_s": f"{PROPAGATION_S:g}",
        }
        response = TemplateResponse(request, "admin/sampling/apikey/created.html", context)
        response["Cache-Control"] = "no-store"
        return response

    @admin.action(description="Revoke the selected keys")
    def revoke(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        with transaction.atomic():  # published once, when all are revoked
            keys = list(queryset)
            for key in keys:
                key.revoked = True
                key.save()
                self.log_change(request, key, [{"changed": {"fields": ["revoked"]}}])
        self.message_user(request, f"{len(keys)} key(s) revoked.", messages.SUCCESS)


class ReadOnlyAdmin(admin.ModelAdmin[Any]):
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(RegisteredModel)
class RegisteredModelAdmin(admin.ModelAdmin[RegisteredModel]):
    list_display = (
        "name",
        "kind",
        "prompt_price",
        "completion_price",
        "batch_price_factor",
        "created",
        "description",
    )
    list_filter = ("kind",)
    search_fields = ("name", "description")

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        # The name is the model's queue: renaming would orphan its workers, policy and usage.
        return ("name", "created") if obj is not None else ("created",)

    def save_model(
        self, request: HttpRequest, obj: RegisteredModel, form: Any, change: bool
    ) -> None:
        super().save_model(request, obj, form, change)
        self.message_user(
            request,
            f"Model {obj.name} saved; every web process serves it as saved within "
            f"{catalog.POLL_INTERVAL_S * 2:g} s.",
            messages.SUCCESS,
        )


class AliasTargetInline(admin.TabularInline[AliasTarget, ModelAlias]):
    model = AliasTarget
    extra = 1
    fields = ("model", "weight", "canary", "ramp_to")


@admin.register(ModelAlias)
class ModelAliasAdmin(admin.ModelAdmin[ModelAlias]):
    list_display = ("name", "split", "created")
    inlines = [AliasTargetInline]

    @admin.display(description="targets (weight)")
    def split(self, obj: ModelAlias) -> str:
        return ", ".join(
            f"{t.model.name} {t.weight}{' (canary)' if t.canary else ''}"
            for t in obj.targets.select_related("model")
        )


@admin.register(CatalogChange)
class CatalogChangeAdmin(ReadOnlyAdmin):
    list_display = ("at", "what")
    readonly_fields = ("at", "what", "details")


@admin.register(PolicyChange)
class PolicyChangeAdmin(ReadOnlyAdmin):
    list_display = ("changed_at", "queue", "version", "action", "changed_by", "summary")
    list_filter = ("queue", "action", "changed_by")
    readonly_fields = ("changed_at", "queue", "version", "action", "changed_by", "old", "new")


@admin.register(StatsMinute)
class StatsMinuteAdmin(ReadOnlyAdmin):
    list_display = (
        "minute", "queue", "requests", "ok", "timeouts", "rejected", "errors", "p99_ms",
        "mean_batch", "fill", "busy",
    )  # fmt: skip
    list_filter = ("queue",)
    date_hierarchy = "minute"
    readonly_fields = ("minute", "queue", "counts")

    @admin.display(description="requests")
    def requests(self, row: StatsMinute) -> int:
        return row.summary.requests()

    @admin.display(description="ok")
    def ok(self, row: StatsMinute) -> int:
        return row.summary.requests(RequestOutcome.OK)

    @admin.display(description="timeouts")
    def timeouts(self, row: StatsMinute) -> int:
        return row.summary.requests(RequestOutcome.TIMEOUT)

    @admin.display(description="rejected")
    def rejected(self, row: StatsMinute) -> int:
        return row.summary.requests(RequestOutcome.REJECTED)

    @admin.display(description="errors")
    def errors(self, row: StatsMinute) -> int:
        return row.summary.requests(RequestOutcome.ERROR)

    @admin.display(description="p99 (ms)")
    def p99_ms(self, row: StatsMinute) -> str:
        return _fmt(row.summary.latency_percentile_ms(99), ",.0f")

    @admin.display(description="mean batch")
    def mean_batch(self, row: StatsMinute) -> str:
        return _fmt(row.summary.mean_batch(), ".1f")

    @admin.display(description="fill")
    def fill(self, row: StatsMinute) -> str:
        return _fmt(row.summary.fill_percent(), ".0f", "%")

    @admin.display(description="GPU busy")
    def busy(self, row: StatsMinute) -> str:
        return _fmt(row.summary.busy_percent(), ".0f", "%")


@admin.register(UsageMinute)
class UsageMinuteAdmin(ReadOnlyAdmin):
    """Every key's usage per minute and model; above the list, the filtered rows summed per
    key and per tier."""

    list_display = (
        "minute", "queue", "key", "tier", "requests_total", "ok", "prompt_tokens",
        "completion_tokens", "tokens",
    )  # fmt: skip
    list_filter = ("tier", "queue", "key")
    date_hierarchy = "minute"
    list_select_related = ("key",)
    readonly_fields = (
        "minute", "queue", "key", "tier", "requests", "prompt_tokens", "completion_tokens",
    )  # fmt: skip

    @admin.display(description="requests")
    def requests_total(self, row: UsageMinute) -> int:
        return row.total_requests

    @admin.display(description="ok")
    def ok(self, row: UsageMinute) -> int:
        return int(row.requests.get(RequestOutcome.OK, 0))

    @admin.display(description="total tokens")
    def tokens(self, row: UsageMinute) -> int:
        return row.total_tokens

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> Any:
        response = super().changelist_view(request, extra_context)
        context = getattr(response, "context_data", None)
        if context and "cl" in context:  # not a redirect or an error page
            rows = context["cl"].queryset.order_by()
            context["usage_by_key"] = usage.totals(rows, "key")
            context["usage_by_tier"] = usage.totals(rows, "tier")
            context["usage_by_model"] = usage.totals(rows, "queue")
        return response


def _recent(rows: QuerySet[UsageMinute]) -> QuerySet[UsageMinute]:
    return rows.filter(minute__gte=timezone.now() - timedelta(days=USAGE_DAYS)).order_by()


def _usage_table(totals: list[usage.Total], query: str) -> str:
    if not totals:
        return "-"
    link = reverse("admin:sampling_usageminute_changelist") + query
    return format_html(
        "<table><tr><th></th><th>requests</th><th>ok</th><th>prompt tokens</th>"
        '<th>completion tokens</th><th>spend</th></tr>{}</table><p><a href="{}">per minute</a></p>',
        format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            (
                (t.label, t.requests, t.ok, t.prompt_tokens, t.completion_tokens, t.spend)
                for t in totals
            ),
        ),
        link,
    )


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"
