"""Operators' data: the sampling policy of each queue, its audit log, per-minute statistics,
API keys and their tiers.

None of these is read on the request path. A saved policy is published to Redis (see
batching/policy.py), from where every web process and worker picks it up within a second;
per-minute statistics are written by one web process at a time, off the request path (see
operations/housekeeping.py). Keys and tiers are published to Redis the same way as the policy
(accounts/access.py).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from decimal import Decimal
from functools import partial
from typing import Any

import redis
from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import close_old_connections, models, transaction
from django.db.models import Max
from django.db.models.signals import post_delete, post_save

from accounts import access
from accounts.budgets import budget_nanos
from batching import policy as live_policy
from batching.policy import MAX_BATCH_SIZE
from batching.topology import REDIS_FAULTS
from serving.redis_client import redis_client
from telemetry.stats import Summary

log = logging.getLogger(__name__)


def default_policy() -> live_policy.Policy:
    """The environment's settings: the policy of a queue without a row (version 0)."""
    return live_policy.policy_from_settings(settings)


def _bounded(name: str, unit: str = "") -> list[Any]:
    low, high = live_policy.BOUNDS[name]
    suffix = f" {unit}" if unit else ""
    return [
        MinValueValidator(low, f"must be at least {live_policy.number(low)}{suffix}"),
        MaxValueValidator(high, f"must be at most {live_policy.number(high)}{suffix}"),
    ]


# Field defaults read the environment when a row is created (callables, so that migrations
# do not freeze one machine's settings).
def _default_queue() -> str:
    return settings.SAMPLING_QUEUE


def policy_default(name: str) -> Any:
    return getattr(default_policy(), name)


def _default(name: str) -> partial[Any]:
    return partial(policy_default, name)


# The policy's settings (every field but the version), as the row and the audit log hold them.
POLICY_FIELDS = tuple(live_policy.SETTING_NAMES)


class SamplingPolicy(models.Model):
    queue = models.CharField(
        max_length=64,
        unique=True,
        default=_default_queue,
        help_text="The Celery queue of the served model (SAMPLING_QUEUE of its processes).",
    )
    max_batch_size = models.PositiveSmallIntegerField(
        default=_default("max_batch_size"),
        validators=_bounded("max_batch_size", "prompts"),
        help_text=f"A batch closes when it holds this many prompts (1 to {MAX_BATCH_SIZE}).",
    )
    deadline_ms = models.PositiveIntegerField(
        "deadline (ms)",
        default=_default("deadline_ms"),
        validators=_bounded("deadline_ms", "ms"),
        help_text="A request gets its completion or a 504 within this many milliseconds.",
    )
    max_prompt_bytes = models.PositiveIntegerField(
        default=_default("max_prompt_bytes"),
        validators=_bounded("max_prompt_bytes", "bytes"),
        help_text="Longer prompts get a 400 at once.",
    )
    max_new_tokens = models.PositiveIntegerField(
        default=_default("max_new_tokens"), validators=_bounded("max_new_tokens", "tokens")
    )
    temperature = models.FloatField(
        default=_default("temperature"),
        validators=_bounded("temperature"),
        help_text="0 is greedy (the same prompt always gets the same completion).",
    )
    top_p = models.FloatField(
        "top-p",
        default=_default("top_p"),
        validators=_bounded("top_p"),
        help_text="Above 0, at most 1 (1: no nucleus cut). Used when temperature is above 0.",
    )
    stop = models.CharField(
        "stop string",
        max_length=200,
        blank=True,
        default=_default("stop"),
        help_text="Completions end before its first occurrence. Empty for none.",
    )
    fill_target_percent = models.PositiveSmallIntegerField(
        "fill target (%)",
        default=_default("fill_target_percent"),
        validators=_bounded("fill_target_percent", "%"),
        help_text="The batch fill the GPU-count recommendation plans for; the rest is headroom.",
    )
    response_cache = models.BooleanField(
        default=_default("response_cache"),
        help_text="Answer a greedy or seeded request from the completion of an identical earlier "
        "one, without a GPU.",
    )
    response_cache_ttl_s = models.PositiveIntegerField(
        "response cache TTL (s)",
        default=_default("response_cache_ttl_s"),
        validators=_bounded("response_cache_ttl_s", "s"),
        help_text="How long a cached completion is served after it was sampled.",
    )
    response_cache_shared = models.BooleanField(
        "share the response cache across API keys",
        default=_default("response_cache_shared"),
        help_text="Off: each API key has its own cached answers. On: one key's identical "
        "request is answered from another's, which reveals to it (by x-cache: hit and a fast "
        "answer) that some key sent that request within the TTL.",
    )
    version = models.PositiveIntegerField(default=0, editable=False)
    updated_at = models.DateTimeField(auto_now=True)
    updated_by = models.CharField(max_length=150, blank=True, editable=False)

    class Meta:
        verbose_name = "sampling policy"
        verbose_name_plural = "sampling policies"

    def __str__(self) -> str:
        return f"policy of queue {self.queue} (version {self.version})"

    def save(self, *args: Any, changed_by: str = "", **kwargs: Any) -> None:
        """Save, record the change, and publish the policy to Redis once committed."""
        with transaction.atomic():
            previous = (
                SamplingPolicy.objects.select_for_update().filter(pk=self.pk).first()
                if self.pk
                else None
            )
            old = previous.as_policy() if previous else default_policy()
            if previous is not None and previous.queue != self.queue:
                # A row moved to another queue: the old queue falls back to its defaults.
                transaction.on_commit(partial(_withdraw, previous.queue))
            self.version = PolicyChange.next_version(self.queue)
            self.updated_by = changed_by
            super().save(*args, **kwargs)
            PolicyChange.objects.create(
                queue=self.queue,
                version=self.version,
                changed_by=changed_by,
                action=PolicyChange.CHANGED if previous else PolicyChange.CREATED,
                old=_settings_of(old),
                new=_settings_of(self.as_policy()),
            )
            published = self.as_policy()
            transaction.on_commit(lambda: _publish(self.queue, published))

    def delete(self, *args: Any, changed_by: str = "", **kwargs: Any) -> Any:
        with transaction.atomic():
            PolicyChange.objects.create(
                queue=self.queue,
                version=PolicyChange.next_version(self.queue),
                changed_by=changed_by,
                action=PolicyChange.DELETED,
                old=_settings_of(self.as_policy()),
                new=_settings_of(default_policy()),
            )
            result = super().delete(*args, **kwargs)
            transaction.on_commit(partial(_withdraw, self.queue))
        return result

    def clean(self) -> None:
        super().clean()
        if self.top_p is not None and self.top_p <= 0:
            raise ValidationError({"top_p": "must be above 0 (1 means no nucleus cut)"})

    def as_policy(self) -> live_policy.Policy:
        return live_policy.Policy(
            **{name: getattr(self, name) for name in POLICY_FIELDS}, version=self.version
        )


def _settings_of(policy: live_policy.Policy) -> dict[str, Any]:
    return {name: getattr(policy, name) for name in POLICY_FIELDS}


def _publish(queue: str, policy: live_policy.Policy) -> None:
    try:
        live_policy.publish(redis_client(), queue, policy)
    except REDIS_FAULTS as exc:  # a cluster's RedisClusterException too
        # Saved all the same: the web processes' housekeeping republishes the database's
        # policy within BACKGROUND_JOB_INTERVAL_S (serving.runtime) once Redis answers.
        log.error("policy of %s saved but not yet published: %s", queue, exc)


def _withdraw(queue: str) -> None:
    try:
        live_policy.withdraw(redis_client(), queue)
    except REDIS_FAULTS as exc:  # a cluster's RedisClusterException too
        log.error("policy of %s deleted but not yet withdrawn: %s", queue, exc)


def known_queues() -> list[str]:
    """This node's default model, the models the environment lists and the registry holds,
    and every queue with a policy row."""

    queues = SamplingPolicy.objects.values_list("queue", flat=True)
    registered = RegisteredModel.objects.values_list("name", flat=True)
    listed = (name for name, _ in settings.SAMPLING_MODELS)
    return sorted({settings.SAMPLING_QUEUE, *listed, *registered, *queues})


class PolicyChange(models.Model):
    """The audit log: one row per saved or deleted policy, never edited."""

    CREATED = "created"
    CHANGED = "changed"
    DELETED = "deleted"

    queue = models.CharField(max_length=64, db_index=True)
    version = models.PositiveIntegerField()
    changed_at = models.DateTimeField(auto_now_add=True, db_index=True)
    changed_by = models.CharField(max_length=150, blank=True)
    action = models.CharField(max_length=10, choices=[(a, a) for a in (CREATED, CHANGED, DELETED)])
    old = models.JSONField(help_text="The settings before (the environment's without a row).")
    new = models.JSONField(help_text="The settings after (the environment's after a delete).")

    class Meta:
        ordering = ["-changed_at", "-id"]
        verbose_name = "policy change"

    def __str__(self) -> str:
        return f"{self.queue} v{self.version} {self.action} by {self.changed_by or '?'}"

    @classmethod
    def next_version(cls, queue: str) -> int:
        return (cls.objects.filter(queue=queue).aggregate(v=Max("version"))["v"] or 0) + 1

    def differences(self) -> dict[str, tuple[Any, Any]]:
        return {
            name: (self.old.get(name), self.new.get(name))
            for name in POLICY_FIELDS
            if self.old.get(name) != self.new.get(name)
        }

    def summary(self) -> str:
        changed = self.differences()
        if not changed:
            return "no setting changed"
        return "; ".join(f"{name}: {old!r} → {new!r}" for name, (old, new) in changed.items())


class StatsMinute(models.Model):
    """One minute of one queue's counters (telemetry/stats.py), for history; rows are deleted
    after SAMPLING_STATS_RETENTION_DAYS."""

    queue = models.CharField(max_length=64)
    minute = models.DateTimeField()
    counts = models.JSONField()

    class Meta:
        ordering = ["-minute"]
        constraints = [
            models.UniqueConstraint(fields=["queue", "minute"], name="one_row_per_queue_minute")
        ]
        indexes = [models.Index(fields=["minute"])]
        verbose_name = "statistics minute"

    def __str__(self) -> str:
        return f"{self.queue} {self.minute:%Y-%m-%d %H:%M}"

    @property
    def summary(self) -> Summary:
        return Summary(Counter(self.counts), 60.0)


# --- who may sample ------------------------------------------------------------------------

_LIMIT_HELP = "0: no limit."


class PublishesAccess(models.Model):
    """A model whose rows are part of the published key and tier records: every save and
    every delete, one row's or a queryset's (the admin's "Delete selected"), republishes
    them once its transaction commits (post_save and post_delete, connected below; a
    queryset's update() sends no signal and is not used on these models)."""

    class Meta:
        abstract = True


class Tier(PublishesAccess):
    """A class of customers: its priority (a free GPU serves the highest waiting tier first)
    and the default limits of its keys. Requests without a key, while keys are not required,
    get the tier named "anonymous"."""

    name = models.SlugField(max_length=32, unique=True)
    priority = models.PositiveSmallIntegerField(
        default=0, help_text="Higher goes first; requests of one priority share batches."
    )
    rpm = models.PositiveIntegerField(
        "requests per minute", default=0, help_text=f"Per key, unless the key says. {_LIMIT_HELP}"
    )
    tpm = models.PositiveIntegerField(
        "completion tokens per minute",
        default=0,
        help_text=f"Per key, unless the key says. {_LIMIT_HELP}",
    )

    class Meta:
        ordering = ["-priority", "name"]

    def __str__(self) -> str:
        return self.name

    def as_caller(self) -> access.Caller:
        return access.Caller(0, self.name, self.name, self.priority, self.rpm, self.tpm)


class ApiKey(PublishesAccess):
    """A client's key. The key itself is shown once, when it is created; only its SHA-256 and
    its first characters are kept."""

    name = models.CharField(max_length=100)
    owner = models.CharField(max_length=150, blank=True)
    tier = models.ForeignKey(Tier, on_delete=models.PROTECT, related_name="keys")
    rpm = models.PositiveIntegerField(
        "requests per minute", null=True, blank=True, help_text="Empty: the tier's."
    )
    tpm = models.PositiveIntegerField(
        "completion tokens per minute", null=True, blank=True, help_text="Empty: the tier's."
    )
    prefix = models.CharField(max_length=16, editable=False)
    digest = models.CharField("SHA-256", max_length=64, unique=True, editable=False)
    created = models.DateTimeField(auto_now_add=True)
    expires = models.DateTimeField(null=True, blank=True, help_text="Empty: never.")
    revoked = models.BooleanField(
        default=False, help_text="A revoked key gets 401 everywhere within a second or two."
    )
    monthly_budget = models.DecimalField(
        max_digits=15,
        decimal_places=6,
        null=True,
        blank=True,
        validators=[MinValueValidator(Decimal(0))],
        help_text="Spend per calendar month (UTC), in the models' price unit: once reached, "
        "the key gets 429 insufficient_quota until the month ends or this rises. Empty: none.",
    )
    last_used = models.DateTimeField(null=True, blank=True, editable=False)
    # The raw key, on the instance that issue() gave it only (never saved): what the admin's
    # response to its creation shows.
    issued_key: str | None = None

    class Meta:
        ordering = ["-created"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}...)"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self.digest:
            raise ValueError("an API key is saved after issue()")
        super().save(*args, **kwargs)

    def issue(self) -> str:
        """Give an unsaved key its secret; returns the key, which is not stored."""
        raw = access.new_key()
        self.digest, self.prefix = access.digest_of(raw), access.visible_prefix(raw)
        return raw

    def as_record(self, owner_budgets: Mapping[str, int] | None = None) -> access.KeyRecord:
        """The key as published; `owner_budgets`: owner -> monthly budget in billionths (the
        owner is published only when it has one: nothing else reads it)."""
        owner_budget = (owner_budgets or {}).get(self.owner, 0) if self.owner else 0
        caller = access.Caller(
            self.pk,
            self.name,
            self.tier.name,
            self.tier.priority,
            self.tier.rpm if self.rpm is None else self.rpm,
            self.tier.tpm if self.tpm is None else self.tpm,
            budget_nanos(self.monthly_budget),
            self.owner if owner_budget else "",
            owner_budget,
        )
        expires_at = self.expires.timestamp() if self.expires else None
        return access.KeyRecord(caller, expires_at, self.revoked)


def access_records() -> dict[str, access.KeyRecord | access.Caller]:
    """What the database says every web process must know: each key's record, each tier."""
    owner_budgets = {b.owner: budget_nanos(b.monthly_budget) for b in OwnerBudget.objects.all()}
    records: dict[str, access.KeyRecord | access.Caller] = {
        key.digest: key.as_record(owner_budgets) for key in ApiKey.objects.select_related("tier")
    }
    for tier in Tier.objects.all():
        records[access.tier_field(tier.name)] = tier.as_caller()
    return records


def publish_after_commit(**_: Any) -> None:
    """Republish once the current transaction commits, once however many rows it changed
    (a bulk delete of a hundred keys publishes once); at once outside a transaction."""
    connection = transaction.get_connection()
    if connection.in_atomic_block and any(
        entry[1] is publish_access for entry in connection.run_on_commit
    ):
        return
    transaction.on_commit(publish_access)


for _model in (Tier, ApiKey):
    post_save.connect(publish_after_commit, sender=_model, dispatch_uid=f"publish-{_model}")
    post_delete.connect(publish_after_commit, sender=_model, dispatch_uid=f"withdraw-{_model}")


def republish_missing_access(client: redis.Redis) -> None:
    """Publish every key and tier from the database unless Redis's set is intact: called by a
    web process's key watcher the moment it finds the set missing (Redis lost its data)."""
    try:
        access.replace_all(client, access_records, unless_intact=True)
    finally:
        close_old_connections()  # the watcher's thread keeps no database connection


def publish_access() -> None:
    """Publish every key and tier (a few thousand records at most: one HSET), replacing what
    Redis had; the web processes apply it within access.POLL_INTERVAL_S."""
    try:
        access.replace_all(redis_client(), access_records)
    except REDIS_FAULTS as exc:
        # Saved all the same: housekeeping republishes what differs once Redis answers.
        log.error("API keys saved but not yet published: %s", exc)


# The model registry's and billing's tables live in their own modules; imported here so
# Django finds them.
from operations.billing import OwnerBudget as OwnerBudget  # noqa: E402
from operations.billing import UsageMinute as UsageMinute  # noqa: E402
from operations.registry import (  # noqa: E402, F401
    AliasTarget,
    CanaryTrial,
    CatalogChange,
    ModelAlias,
    RegisteredModel,
)

post_save.connect(publish_after_commit, sender=OwnerBudget, dispatch_uid="publish-owner-budget")
post_delete.connect(publish_after_commit, sender=OwnerBudget, dispatch_uid="withdraw-owner-budget")
