"""`python manage.py setownerbudget OWNER AMOUNT|none`: give every API key whose owner is
OWNER one monthly budget together (`none` removes it). Published with the keys: every web
process applies it within a second or two."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from accounts import access
from operations.management.commands.createapikey import budget_amount
from operations.models import ApiKey, OwnerBudget


class Command(BaseCommand):
    help = "Set (or remove, with 'none') the monthly budget shared by an owner's API keys."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("owner", help="exactly as the keys' owner says it")
        parser.add_argument("amount", help="spend per calendar month (UTC), or 'none'")

    def handle(self, *args: Any, **options: Any) -> None:
        owner = options["owner"]
        if not owner:
            raise CommandError("the owner is not empty: keys without an owner share nothing")
        keys = ApiKey.objects.filter(owner=owner).count()
        with transaction.atomic():
            if options["amount"].lower() == "none":
                deleted, _ = OwnerBudget.objects.filter(owner=owner).delete()
                said = "removed" if deleted else "was not set"
            else:
                amount = budget_amount(options["amount"], "amount")
                OwnerBudget.objects.update_or_create(
                    owner=owner, defaults={"monthly_budget": amount}
                )
                said = f"set to {amount} a month"
        self.stdout.write(
            f"the budget of {owner!r} ({keys} key(s)) {said}; every web process applies it "
            f"within {access.POLL_INTERVAL_S * 2:g} s"
        )
