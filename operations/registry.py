"""The model registry: the models operators register (a name, which is the model's queue; a
kind; a description; prices per 1,000 prompt and completion tokens) and the aliases that
split traffic among them by weight, with their history.

Not read on the request path: every change is published to Redis as one catalog
(batching.catalog), after its transaction commits, with the time of the change that made it
(µs) as its version; every web process applies it within a second. Housekeeping republishes
it when Redis lost it or missed a save (operations.housekeeping).
"""

from __future__ import annotations

import logging
from decimal import Decimal
from typing import Any

import redis
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models, transaction
from django.db.models.signals import post_delete, post_save

from batching import catalog as live_catalog
from batching.topology import REDIS_FAULTS
from serving.redis_client import redis_client
from telemetry import canary as live_canary

log = logging.getLogger(__name__)

NAME_VALIDATOR = RegexValidator(
    r"^[A-Za-z0-9._-]{1,64}$", "1-64 letters, digits, '-', '_' or '.' (it names the queue)"
)
# Prices per 1,000 tokens: up to 999,999.999999, exact to a millionth.
PRICE_MAX_DIGITS, PRICE_DECIMAL_PLACES = 12, 6


class RegisteredModel(models.Model):
    name = models.CharField(
        max_length=64,
        unique=True,
        validators=[NAME_VALIDATOR],
        help_text="The model's id in the API, and its queue: its workers run with "
        "SAMPLING_QUEUE set to it.",
    )
    kind = models.CharField(
        max_length=16,
        choices=[(kind, kind) for kind in live_catalog.KINDS],
        default=live_catalog.GENERATOR,
        help_text="generator: completions and chat; embedder: embeddings.",
    )
    description = models.TextField(blank=True)
    prompt_price = models.DecimalField(
        max_digits=PRICE_MAX_DIGITS,
        decimal_places=PRICE_DECIMAL_PLACES,
        default=Decimal(0),
        validators=[MinValueValidator(Decimal(0))],
        help_text="Per 1,000 prompt tokens.",
    )
    completion_price = models.DecimalField(
        max_digits=PRICE_MAX_DIGITS,
        decimal_places=PRICE_DECIMAL_PLACES,
        default=Decimal(0),
        validators=[MinValueValidator(Decimal(0))],
        help_text="Per 1,000 completion tokens.",
    )
    batch_price_factor = models.DecimalField(
        max_digits=3,
        decimal_places=2,
        default=Decimal(live_catalog.DEFAULT_BATCH_PRICE_FACTOR),
        validators=[MinValueValidator(Decimal(0)), MaxValueValidator(Decimal(1))],
        help_text="Offline jobs' tokens (the Batch API) pay the prices times this, 0 to 1.",
    )
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        verbose_name = "model"

    def __str__(self) -> str:
        return self.name

    def as_entry(self) -> live_catalog.ModelEntry:
        return live_catalog.ModelEntry(
            self.name,
            self.kind,
            self.description,
            str(self.prompt_price),
            str(self.completion_price),
            int(self.created.timestamp()),
            str(self.batch_price_factor),
        )


class ModelAlias(models.Model):
    name = models.CharField(
        max_length=64,
        unique=True,
        validators=[NAME_VALIDATOR],
        help_text="The public name a request may use in place of one of its targets.",
    )
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        verbose_name = "alias"
        verbose_name_plural = "aliases"

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        super().clean()
        if RegisteredModel.objects.filter(name=self.name).exists():
            raise ValidationError({"name": "a model has this name"})

    def as_alias(self) -> live_catalog.Alias:
        targets = tuple(
            live_catalog.Target(target.model.name, target.weight, target.canary)
            for target in self.targets.select_related("model").order_by("model__name")
        )
        return live_catalog.Alias(self.name, targets, int(self.created.timestamp()))


class AliasTarget(models.Model):
    alias = models.ForeignKey(ModelAlias, on_delete=models.CASCADE, related_name="targets")
    model = models.ForeignKey(RegisteredModel, on_delete=models.PROTECT, related_name="+")
    weight = models.PositiveIntegerField(
        validators=[MaxValueValidator(live_catalog.MAX_WEIGHT)],
        help_text=f"Relative, 0 to {live_catalog.MAX_WEIGHT}: 90 and 10 split 90/10; 0 sends "
        "it nothing.",
    )
    canary = models.BooleanField(
        default=False,
        help_text="A new version on trial: set to weight 0 by the service itself when it "
        "does worse than the alias's other targets.",
    )
    ramp_to = models.PositiveIntegerField(
        default=0,
        validators=[MaxValueValidator(live_catalog.MAX_WEIGHT)],
        help_text="A canary's ramp: its weight doubles each SAMPLING_CANARY_RAMP_EVERY_S its "
        "trial watches it with nothing worse and no capacity refusal, up to this; 0: none.",
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["alias", "model"], name="one_target_per_model")
        ]

    def __str__(self) -> str:
        ramp = f", ramp to {self.ramp_to}" if self.ramp_to else ""
        return f"{self.alias} -> {self.model} ({self.weight}{ramp})"


class CatalogChange(models.Model):
    """The registry's history, never edited: one row per change; the newest row's time is
    the published catalog's version."""

    at = models.DateTimeField(auto_now_add=True)
    what = models.CharField(max_length=200)
    details = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-id"]
        verbose_name = "registry change"

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.what}"


class CanaryTrial(models.Model):
    """A canary's trial against its alias's other targets (operations.canary): the running
    sums of its sequential test, where they stand and its state. Named by the alias and the
    model, not the target row, which `setalias` replaces: a trial outlives a weight change."""

    alias = models.CharField(max_length=64)
    model = models.CharField(max_length=64)
    target_id = models.BigIntegerField(default=0, help_text="The alias target it judges.")
    started = models.DateTimeField(auto_now_add=True)
    through_s = models.BigIntegerField(help_text="The start (epoch s) of the last 10 s counted.")
    state = models.CharField(max_length=16, default=live_canary.TOO_EARLY)
    sums = models.JSONField(default=dict, blank=True)
    readings = models.JSONField(default=list, blank=True)
    ramp_since = models.FloatField(
        default=0.0, help_text="Since when (epoch s) its ramp's step has been watched."
    )
    rolled_back_s = models.FloatField(default=0.0, help_text="When it was rolled back (epoch s).")
    updated = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["alias", "model"], name="one_trial_per_canary")
        ]

    def __str__(self) -> str:
        return f"{self.model} of {self.alias}: {self.state}"

    def offline(self) -> str:
        """Its offline lines on each side (a class of their own, outside the verdict)."""
        try:
            return live_canary.offline_summary(live_canary.Trial.from_json(self.sums))
        except (KeyError, TypeError, ValueError):
            return "offline lines: not read"


def catalog_snapshot() -> live_catalog.Catalog:
    """What the database registers, as published: its version is the time of the newest
    change (µs), so that it orders publishers of one database, and a database made after
    the catalog in Redis (a new installation on an old Redis) replaces it."""
    newest = CatalogChange.objects.order_by("-id").values_list("at", flat=True).first()
    aliases = ModelAlias.objects.prefetch_related("targets__model")
    return live_catalog.Catalog.of(
        (model.as_entry() for model in RegisteredModel.objects.all()),
        (alias.as_alias() for alias in aliases),
        round(newest.timestamp() * 1_000_000) if newest else 0,
    )


def publish_catalog(client: redis.Redis | None = None) -> None:
    try:
        live_catalog.publish(client or redis_client(), catalog_snapshot())
    except REDIS_FAULTS as exc:
        # Saved all the same: housekeeping republishes what differs once Redis answers.
        log.error("model registry saved but not yet published: %s", exc)


def record_change(what: str, **details: Any) -> CatalogChange:
    """One line of history, and the catalog published once the transaction commits."""
    change = CatalogChange.objects.create(what=what[:200], details=details)
    transaction.on_commit(publish_catalog)
    return change


def _on_save(sender: type[models.Model], instance: Any, created: bool, **_: Any) -> None:
    record_change(f"{'added' if created else 'changed'} {sender._meta.verbose_name} {instance}")


def _on_delete(sender: type[models.Model], instance: Any, **_: Any) -> None:
    record_change(f"deleted {sender._meta.verbose_name} {instance}")


for _sender in (RegisteredModel, ModelAlias, AliasTarget):
    post_save.connect(_on_save, sender=_sender, dispatch_uid=f"catalog-save-{_sender.__name__}")
    post_delete.connect(
        _on_delete, sender=_sender, dispatch_uid=f"catalog-delete-{_sender.__name__}"
    )
