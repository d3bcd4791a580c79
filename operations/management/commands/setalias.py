"""`python manage.py setalias NAME MODEL=WEIGHT[:canary] ...`: make NAME an alias whose
requests go to its targets by weight (90 and 10 split 90/10; `:canary` marks a target the
service rolls back by itself), replacing its targets; `--delete` removes the alias. Targets
must be registered models (`manage.py registermodel`)."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from batching import catalog
from operations.registry import AliasTarget, ModelAlias, RegisteredModel


def _target(text: str) -> tuple[str, int, bool]:
    model, _, rest = text.partition("=")
    weight, _, flag = rest.partition(":")
    if not model or not weight.isdigit() or flag not in ("", "canary"):
        raise CommandError(f"a target is MODEL=WEIGHT or MODEL=WEIGHT:canary, got {text!r}")
    return model, int(weight), flag == "canary"


class Command(BaseCommand):
    help = "Set an alias's weighted targets (MODEL=WEIGHT[:canary] ...), or --delete it."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="the alias, a name requests may use as their model")
        parser.add_argument("targets", nargs="*", help="MODEL=WEIGHT or MODEL=WEIGHT:canary")
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
            for model_name, weight, canary in targets:
                model = RegisteredModel.objects.filter(name=model_name).first()
                if model is None:
                    raise CommandError(f"no registered model {model_name!r}")
                target = AliasTarget(alias=alias, model=model, weight=weight, canary=canary)
                try:
                    target.full_clean()
                except ValidationError as exc:
                    raise CommandError(f"{model_name}: {'; '.join(exc.messages)}") from None
                target.save()
        split = ", ".join(f"{m} {w}{' (canary)' if c else ''}" for m, w, c in targets)
        self.stdout.write(
            f"alias {name}: {split}; served so within {catalog.POLL_INTERVAL_S * 2:g} s"
        )
