"""`python manage.py createapikey NAME [--tier T] [--rpm N] [--tpm N] [--expires DATE]
[--monthly-budget AMOUNT]`: create
an API key and print it on the last line of stdout (the only time it is shown). The key is
published to Redis (REDIS_URL, as every process reads it): it works within a second or two."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction
from django.utils.dateparse import parse_date, parse_datetime

from accounts import access
from operations.models import ApiKey, Tier


def _expiry(text: str) -> datetime:
    moment = parse_datetime(text)
    if moment is None:
        day = parse_date(text)
        if day is None:
            raise CommandError(f"--expires: {text!r} is not a date (YYYY-MM-DD) or a datetime")
        moment = datetime(day.year, day.month, day.day, tzinfo=UTC)
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def budget_amount(text: str, what: str = "--monthly-budget") -> Decimal:
    """A budget as the registry keeps it: 0 or more, with at most 6 decimals."""
    try:
        budget = Decimal(text)
    except InvalidOperation:
        raise CommandError(f"{what}: {text!r} is not a decimal number") from None
    if not budget.is_finite() or not 0 <= budget < 10**9:
        raise CommandError(f"{what} is 0 or more and under 1000000000")
    if budget != budget.quantize(Decimal("0.000001")):
        raise CommandError(f"{what} has at most 6 decimals")
    return budget


class Command(BaseCommand):
    help = "Create an API key; the key is printed on the last line, once."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="who or what the key is for")
        parser.add_argument("--tier", default="free", help="the key's tier (default: free)")
        parser.add_argument("--owner", default="", help="a contact, for operators")
        parser.add_argument("--rpm", type=int, help="requests per minute (0: none; default: tier)")
        parser.add_argument("--tpm", type=int, help="completion tokens per minute (as --rpm)")
        parser.add_argument("--expires", help="YYYY-MM-DD or an ISO datetime (UTC if no zone)")
        parser.add_argument(
            "--monthly-budget", type=budget_amount, help="spend per calendar month (default: none)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        tier = Tier.objects.filter(name=options["tier"]).first()
        if tier is None:
            names = ", ".join(Tier.objects.values_list("name", flat=True))
            raise CommandError(f"no tier {options['tier']!r} (tiers: {names})")
        for limit in ("rpm", "tpm"):
            if options[limit] is not None and options[limit] < 0:
                raise CommandError(f"--{limit} must be 0 (no limit) or more")
        expires = _expiry(options["expires"]) if options["expires"] else None
        if expires is not None and expires <= datetime.now(UTC):
            raise CommandError(f"--expires {options['expires']} is in the past")
        key = ApiKey(
            name=options["name"], owner=options["owner"], tier=tier, rpm=options["rpm"],
            tpm=options["tpm"], expires=expires, monthly_budget=options["monthly_budget"],
        )  # fmt: skip
        raw = key.issue()
        with transaction.atomic():
            key.save()
        self.stdout.write(
            f"API key {key.pk} {key.name!r} (tier {tier.name}) created; it is shown once, "
            f"below, and works within {access.POLL_INTERVAL_S * 2:g} s:"
        )
        self.stdout.write(raw)
