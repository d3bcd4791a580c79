"""Billing's tables: what each API key used, minute by minute, and the owners' monthly
budgets (a key's own budget is a field of the key: operations.models.ApiKey).

An owner is the keys' `owner` text, as operators write it: every key whose owner is exactly
an OwnerBudget's shares that budget (accounts.budgets), beside any budget of its own.
"""

from __future__ import annotations

from decimal import Decimal

from django.core.validators import MinValueValidator
from django.db import models


class OwnerBudget(models.Model):
    """A monthly budget shared by every key of one owner: once their spend this month adds up
    to it, all of them get 429 insufficient_quota until the month ends or it rises. Published
    with the keys (each key's record carries its owner's budget): a save or delete republishes
    them (operations.models connects it, as for keys and tiers)."""

    owner = models.CharField(
        max_length=150, unique=True, help_text="Exactly as the keys' owner field says it."
    )
    monthly_budget = models.DecimalField(
        max_digits=15,
        decimal_places=6,
        validators=[MinValueValidator(Decimal(0))],
        help_text="Spend per calendar month (UTC) of all the owner's keys together, in the "
        "models' price unit.",
    )

    class Meta:
        ordering = ["owner"]
        verbose_name = "owner's budget"

    def __str__(self) -> str:
        return f"{self.owner}: {self.monthly_budget} a month"


class UsageMinute(models.Model):
    """One minute of one API key's use of one model (queue): requests by outcome and tokens,
    from the per-key fields of the statistics buckets (telemetry/stats.py), written with the
    minute's StatsMinute row and pruned with it. The key's tier is kept as it was then."""

    queue = models.CharField("model", max_length=64)
    minute = models.DateTimeField()
    key = models.ForeignKey(
        "sampling.ApiKey",
        on_delete=models.SET_NULL,
        null=True,
        related_name="usage",
        db_index=False,
    )
    tier = models.CharField(max_length=32, help_text="The key's tier at the time.")
    requests = models.JSONField(help_text="Requests by outcome.")
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(
        default=0, help_text="Of the prompt tokens: those of prompts answered from the cache."
    )
    spend_nanos = models.PositiveBigIntegerField(
        "spend (billionths)",
        default=0,
        help_text="What the answers cost at the model's price when each was answered, in "
        "billionths of the price's unit.",
    )

    class Meta:
        ordering = ["-minute"]
        constraints = [
            models.UniqueConstraint(
                fields=["queue", "minute", "key"], name="one_usage_row_per_queue_minute_key"
            )
        ]
        indexes = [
            models.Index(fields=["key", "minute"]),
            models.Index(fields=["tier", "minute"]),
            models.Index(fields=["minute"], name="usage_minute_idx"),
        ]
        verbose_name = "usage minute"

    def __str__(self) -> str:
        return f"{self.key or 'deleted key'} on {self.queue} {self.minute:%Y-%m-%d %H:%M}"

    @property
    def total_requests(self) -> int:
        return sum(self.requests.values())

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens
