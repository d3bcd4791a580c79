"""An offline job's charges (offline.charges) against Django's test database and a real Redis:
answered lines settled once with their spend at the job's own price, and each charge reaching
the key's statistics and month total once, however often it is sent (a feeder killed after
sending, two feeders at once)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import redis
from django.core.files.base import ContentFile
from django.utils import timezone

from accounts.budgets import Budgets
from batching.catalog import Price
from batching.keys import QueueKeys
from offline import charges
from offline.models import Job, JobLine, StoredFile
from telemetry.flush import MONTH_TTL_S
from tests.support import unique_queue

pytestmark = pytest.mark.django_db

PRICE = Price(3, 7)
KEY = 41


def _job(queue: str, lines: int) -> Job:
    stored = StoredFile(key_id=KEY, purpose="batch", filename="in.jsonl", size=1, lines=lines)
    stored.content.save("in.jsonl", ContentFile(b"{}\n"), save=True)
    job = Job.objects.create(key_id=KEY, model=queue, endpoint="/v1/chat/completions",
                             input_file=stored, total=lines, expires_at=timezone.now()
                             + timedelta(hours=1), prompt_price_nanos=PRICE.prompt_nanos,
                             completion_price_nanos=PRICE.completion_nanos)  # fmt: skip
    JobLine.objects.bulk_create(JobLine(job=job, line=i, custom_id=f"c{i}") for i in range(lines))
    return job


def _ok(prompt: int, completion: int) -> tuple[int, dict[str, object]]:
    return 200, {"usage": {"prompt_tokens": prompt, "completion_tokens": completion}}


def _month_spend(client: redis.Redis, queue: str) -> int:
    budgets = Budgets(client)
    budgets.refresh({KEY: 10**9}, [queue])
    return budgets.spent.get(KEY, 0)


def test_a_charge_sent_twice_is_counted_once(redis_client: redis.Redis, settings: object) -> None:
    queue = unique_queue("charges")
    job = _job(queue, 3)
    settled = charges.settle(job, {0: _ok(5, 2), 1: _ok(4, 1)}, charges.price_of(job, None))
    assert (settled.lines, settled.prompt_tokens, settled.completion_tokens) == (2, 9, 3)
    assert charges.settle(job, {0: _ok(5, 2)}, PRICE).lines == 0  # answered already
    spend = PRICE.of(9, 3)
    assert charges.send_charge(redis_client, job.id, queue)
    # A feeder killed after the flush and before the mark: the same charge goes again.
    resent = {"charging_prompt_tokens": 9, "charging_completion_tokens": 3,
              "charging_spend_nanos": spend}  # fmt: skip
    Job.objects.filter(id=job.id).update(charges_sent=0, **resent)
    assert charges.send_charge(redis_client, job.id, queue)
    assert not charges.send_charge(redis_client, job.id, queue)  # nothing left
    charges.settle(job, {2: _ok(1, 1)}, PRICE)
    assert charges.send_charge(redis_client, job.id, queue)
    job.refresh_from_db()
    assert (job.spend_nanos, job.charges_sent) == (spend + PRICE.of(1, 1), 2)
    assert _month_spend(redis_client, queue) == job.spend_nanos
    # Its sequences kept apart, as long as the month's totals: a resend weeks later is known.
    applied = QueueKeys(queue).job_charges_applied(job.id)
    assert redis_client.ttl(applied) > MONTH_TTL_S - 60
    assert not redis_client.hexists(QueueKeys(queue).stats_applied, charges.WRITER_PREFIX + job.id)


def test_a_job_pays_its_own_price_whatever_the_catalog_says_later() -> None:
    """Priced when validated: a price raised, or the model removed from the catalog (None),
    after that changes nothing; a job from before prices were kept pays the catalog's."""
    priced = Job(prompt_price_nanos=3, completion_price_nanos=7)
    assert charges.price_of(priced, Price(100, 100)) == Price(3, 7)
    assert charges.price_of(priced, None) == Price(3, 7)
    older = Job()
    assert charges.price_of(older, Price(100, 100)) == Price(100, 100)
    assert charges.price_of(older, None) == Price()
