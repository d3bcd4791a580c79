"""`python manage.py setalias NAME MODEL=WEIGHT[:canary[:ramp=N]] ...`: make NAME an alias
whose requests go to its targets by weight (90 and 10 split 90/10; `:canary` marks a target
the service rolls back by itself, `:ramp=N` one whose weight it doubles up to N while its
trial finds nothing worse), replacing its targets; `--delete` removes the alias. Targets
must be registered models (`manage.py registermodel`)."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from batching import catalog
from operations.registry import AliasTarget, ModelAlias, RegisteredModel


def _target(text: str) -> tuple[str, int, bool, int]:
    """MODEL=WEIGHT, with `:canary` for a canary, and `:ramp=N` for a canary's ramp."""
    model, _, rest = text.partition("=")
    weight, *flags = rest.split(":")
    ramps = [flag.removeprefix("ramp=") for flag in flags if flag.startswith("ramp=")]
    known = flags.count("canary") + len(ramps) == len(flags) and len(flags) <= 2
    if not model or not weight.isdigit() or not known or not all(r.isdigit() for r in ramps):
        raise CommandError(
            f"a target is MODEL=WEIGHT, MODEL=WEIGHT:canary or MODEL=WEIGHT:canary:ramp=N, "
            f"got {text!r}"
        )
    if ramps and "canary" not in flags:
        raise CommandError(f"only a canary ramps: {text!r}")
    return model, int(weight), "canary" in flags, int(ramps[0]) if ramps else 0


class Command(BaseCommand):
    help = "Set an alias's weighted targets (MODEL=WEIGHT[:canary[:ramp=N]] ...), or --delete it."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="the alias, a name requests may use as their model")
        parser.add_argument(
            "targets",
            nargs="*",
            help="MODEL=WEIGHT, MODEL=WEIGHT:canary or MODEL=WEIGHT:canary:ramp=N",
        )
        parser.add_argument("--delete", action="store_true", help="remove the alias")

    def handle(self, *args: Any, **options: Any) -> None:
        name = options["name"]
        targets = [_target(text) for text in options["targets"]]
        with transaction.atomic():
            alias = ModelAlias.objects.select_for_update().filter(name=name).first()
            if options["delete"]:
                if alias is None:
                    raise CommandError(f"no alias {name!r}")
                alias.delete()
                self.stdout.write(f"alias {name} removed")
                return
            if not targets:
                raise CommandError("name at least one target: MODEL=WEIGHT")
            alias = alias or ModelAlias(name=name)
            try:
                alias.full_clean()
            except ValidationError as exc:
                raise CommandError("; ".join(exc.messages)) from None
            alias.save()
            alias.targets.all().delete()
            for model_name, weight, canary, ramp_to in targets:
                model = RegisteredModel.objects.filter(name=model_name).first()
                if model is None:
                    raise CommandError(f"no registered model {model_name!r}")
                target = AliasTarget(
                    alias=alias, model=model, weight=weight, canary=canary, ramp_to=ramp_to
                )
                try:
                    target.full_clean()
                except ValidationError as exc:
                    raise CommandError(f"{model_name}: {'; '.join(exc.messages)}") from None
                target.save()
        split = ", ".join(f"{m} {w}{' (canary)' if c else ''}" for m, w, c, _ in targets)
        self.stdout.write(
            f"alias {name}: {split}; served so within {catalog.POLL_INTERVAL_S * 2:g} s"
        )
