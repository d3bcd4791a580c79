"""`python manage.py registermodel NAME [--kind generator|embedder] [--description TEXT]
[--prompt-price P] [--completion-price P] [--batch-price-factor F]`: register a model, or
change a registered one (`--delete`: unregister it). Published to Redis at once: every web
process serves it as saved within a second or two."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction
from django.db.models import ProtectedError

from batching import catalog
from operations.registry import RegisteredModel


def _price(text: str) -> Decimal:
    try:
        return Decimal(text)
    except InvalidOperation:
        raise CommandError(f"{text!r} is not a price (a decimal number)") from None


class Command(BaseCommand):
    help = "Register a model (its name is its queue), or change or --delete a registered one."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="the model's id in the API, and its queue")
        parser.add_argument("--kind", choices=catalog.KINDS, help="default: generator")
        parser.add_argument("--description")
        parser.add_argument("--prompt-price", type=_price, help="per 1,000 prompt tokens")
        parser.add_argument("--completion-price", type=_price, help="per 1,000 completion tokens")
        parser.add_argument(
            "--batch-price-factor",
            type=_price,
            help="offline jobs pay the prices times this, 0 to 1 (default "
            f"{catalog.DEFAULT_BATCH_PRICE_FACTOR})",
        )
        parser.add_argument("--delete", action="store_true", help="unregister the model")

    def handle(self, *args: Any, **options: Any) -> None:
        name = options["name"]
        with transaction.atomic():
            found = RegisteredModel.objects.select_for_update().filter(name=name).first()
            if options["delete"]:
                self._delete(found, name)
                return
            model = found or RegisteredModel(name=name)
            for field in (
                "kind",
                "description",
                "prompt_price",
                "completion_price",
                "batch_price_factor",
            ):
                if options[field] is not None:
                    setattr(model, field, options[field])
            try:
                model.full_clean()
            except ValidationError as exc:
                raise CommandError("; ".join(exc.messages)) from None
            model.save()
        self.stdout.write(
            f"model {name} {'changed' if found else 'registered'} ({model.kind}, "
            f"{model.prompt_price} / {model.completion_price} per 1,000 prompt / completion "
            f"tokens, offline jobs x {model.batch_price_factor}); served as saved within "
            f"{catalog.POLL_INTERVAL_S * 2:g} s"
        )

    def _delete(self, found: RegisteredModel | None, name: str) -> None:
        if found is None:
            raise CommandError(f"no registered model {name!r}")
        try:
            found.delete()
        except ProtectedError:
            raise CommandError(
                f"model {name!r} is the target of an alias: change it first"
            ) from None
        self.stdout.write(f"model {name} unregistered")
