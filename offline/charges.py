"""An offline job's lines written with their answers, and what they cost charged to its key
exactly once, whatever kills the feeder on the way.

`settle` writes answered lines in one transaction with the job's counts, its tokens, its
spend at its frozen price (Job.prompt_price_nanos) and the same usage as "uncharged".
`send_charge` then fixes the uncharged usage as the job's next charge (in the database), sends
it to the key's statistics in Redis as one flush (telemetry.flush) under the job's own writer
id and the charge's sequence, and marks it sent. A feeder killed (or stalled) anywhere on the
way leaves the charge to be sent again, the same counts under the same sequence: Redis applies
a writer's sequence once. So a line's usage and spend reach the key's statistics, its month's
budget total and, through housekeeping, the database, once each.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from django.db import transaction
from django.db.models import F, Q

from batching.catalog import Price
from batching.keys import QueueKeys
from offline.models import Job, JobLine
from telemetry.flush import MONTH_TTL_S, Flusher
from telemetry.stats import COMPLETION_TOKENS, PROMPT_TOKENS, SPEND, usage_field

# The writer id of a job's charges in the statistics' flush bookkeeping.
WRITER_PREFIX = "job:"
# The jobs with a charge left to send.
PENDING = (Q(uncharged_prompt_tokens__gt=0) | Q(uncharged_completion_tokens__gt=0)
           | Q(uncharged_spend_nanos__gt=0) | Q(charging_prompt_tokens__gt=0)
           | Q(charging_completion_tokens__gt=0) | Q(charging_spend_nanos__gt=0))  # fmt: skip


# What a job's tokens cost, given the job (its own price, else the catalog's: price_of).
PriceOf = Callable[[Job], Price]


@dataclass
class Settled:
    """Lines answered by one `settle`, their 200s' tokens, and how many were 200s and 5xxs."""

    lines: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ok: int = 0
    errors: int = 0  # the service's own failures (5xx), as a request's `error` outcome


def price_of(job: Job, current: Price | None) -> Price:
    """What a job's tokens cost: its price when it was validated, else (a job from before
    prices were kept) `current`, the catalog's, else nothing."""
    if job.prompt_price_nanos is not None and job.completion_price_nanos is not None:
        return Price(job.prompt_price_nanos, job.completion_price_nanos)
    return current or Price()


def _tokens(status: int, body: dict[str, Any]) -> tuple[int, int]:
    """A line's tokens, as its body's usage reports them (an embedding's: prompt tokens)."""
    usage = body.get("usage") if status == 200 else None
    if not usage:
        return 0, 0
    return int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))


def settle(job: Job, outcomes: dict[int, tuple[int, dict[str, Any]]], price: Price) -> Settled:
    """Lines answered (status, body), those not answered before only; the job's counts,
    tokens and spend raised by them, and left to charge, in the same transaction."""
    with transaction.atomic():
        # Locked (PostgreSQL): a feeder that stalled past its lock, writing the same lines
        # as its successor, finds them answered once it has the rows, and counts nothing.
        rows = list(JobLine.objects.select_for_update().filter(
            job=job, line__in=list(outcomes), answered=False))  # fmt: skip
        settled = Settled(len(rows))
        for row in rows:
            row.status_code, row.body = outcomes[row.line]
            row.answered = True
            prompt, completion = _tokens(row.status_code, row.body)
            settled.prompt_tokens += prompt
            settled.completion_tokens += completion
        JobLine.objects.bulk_update(rows, ["answered", "status_code", "body"])
        ok = sum(1 for row in rows if row.ok)
        settled.ok, settled.errors = ok, sum(1 for row in rows if (row.status_code or 0) >= 500)
        spend = price.of(settled.prompt_tokens, settled.completion_tokens)
        Job.objects.filter(id=job.id).update(
            completed=F("completed") + ok,
            failed=F("failed") + len(rows) - ok,
            prompt_tokens=F("prompt_tokens") + settled.prompt_tokens,
            completion_tokens=F("completion_tokens") + settled.completion_tokens,
            spend_nanos=F("spend_nanos") + spend,
            uncharged_prompt_tokens=F("uncharged_prompt_tokens") + settled.prompt_tokens,
            uncharged_completion_tokens=F("uncharged_completion_tokens")
            + settled.completion_tokens,
            uncharged_spend_nanos=F("uncharged_spend_nanos") + spend,
        )
    return settled


def send_charge(client: redis.Redis, job_id: str, queue: str) -> bool:
    """The job's uncharged usage sent to its key's statistics of `queue`; whether a charge
    went. A charge's content is fixed in the database before it is sent (Job.charging_*), so
    that every sending of sequence N carries the same counts, whoever sends it: a feeder that
    stalled and one that took over both may. Redis errors are raised; the charge goes again
    next time, as it was."""
    if not Job.objects.filter(PENDING, id=job_id).exists():
        return False  # nothing to send: no write transaction
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(id=job_id).first()
        if job is None:
            return False
        queue = job.model or queue  # a feeder that stalled may hold a job that moved since
        if not any(_charging(job)) and _uncharged(job):
            job.charging_prompt_tokens = job.uncharged_prompt_tokens
            job.charging_completion_tokens = job.uncharged_completion_tokens
            job.charging_spend_nanos = job.uncharged_spend_nanos
            job.uncharged_prompt_tokens = job.uncharged_completion_tokens = 0
            job.uncharged_spend_nanos = 0
            job.save(update_fields=[*CHARGING, *UNCHARGED])
    prompt, completion, spend = _charging(job)
    if not (prompt or completion or spend):
        return False
    key = job.key_id
    fields = {
        usage_field(key, PROMPT_TOKENS): prompt,
        usage_field(key, COMPLETION_TOKENS): completion,
        usage_field(key, SPEND): spend,
    }
    applied = QueueKeys(queue).job_charges_applied(job.id)  # outlives any wait for a resend
    flusher = Flusher(queue, writer=WRITER_PREFIX + job.id, sequence=job.charges_sent,
                      applied=applied, applied_ttl_s=MONTH_TTL_S)  # fmt: skip
    flusher.add({int(time.time()): fields})
    flusher.send(client)  # applied once per sequence, however often it is sent
    Job.objects.filter(id=job.id, charges_sent=job.charges_sent).update(
        **dict.fromkeys(CHARGING, 0), charges_sent=job.charges_sent + 1
    )
    return True


CHARGING = ["charging_prompt_tokens", "charging_completion_tokens", "charging_spend_nanos"]
UNCHARGED = ["uncharged_prompt_tokens", "uncharged_completion_tokens", "uncharged_spend_nanos"]


def _charging(job: Job) -> tuple[int, int, int]:
    return job.charging_prompt_tokens, job.charging_completion_tokens, job.charging_spend_nanos


def _uncharged(job: Job) -> bool:
    return bool(job.uncharged_prompt_tokens or job.uncharged_completion_tokens
                or job.uncharged_spend_nanos)  # fmt: skip
