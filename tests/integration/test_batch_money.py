"""What an offline job may spend, against real processes and the `openai` client: a stack of a
priced generator, one worker of small calls, a feeder whose lock passes on within seconds.

- A key refused 429 `insufficient_quota` cannot create a job: the same error.
- A key whose budget is crossed while its job runs: its waiting lines are withdrawn, the lines
  left are failed with `insufficient_quota`, and its spend is exactly its answered lines'.
- A key revoked while its job runs: the lines left are failed with 401 `invalid_api_key`.
- A key whose jobs would hold more unanswered lines than SAMPLING_BATCH_MAX_ENQUEUED_LINES:
  the job fails validation with `token_limit_exceeded`.
- A feeder killed (SIGKILL) again and again while it writes a job's answers: the key's usage
  and spend are still exactly the job's.
"""

from __future__ import annotations

import functools
import json
import os
import signal
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import openai
import pytest
from openai import OpenAI

from devstack.stack import Stack
from offline.feeder import AHEAD_CALLS
from tests.support import unique_queue
from tests.support.batches import (
    chat_lines,
    completed,
    create,
    ended,
    line_cost,
    new_key,
    priced_stack,
    records,
    usage_of,
)
from tests.support.manage import manage
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

# Small calls on one worker: jobs last seconds with few lines, and little CPU.
MAX_BATCH = 20
WORKERS = 1
LOCK_TTL_S = 3
LONG_JOB = 2000  # 100 calls of 20 lines: 5 s of 50 ms calls at the least
BIG_JOB = 3000  # 7.5 s of calls at the least: a key revoked, a job created, well before its end
ENQUEUED_LIMIT = 4000
# Lines a key's job may answer past the crossing of its budget: those taken or answered when
# the feeder sees it (at most what the lanes held for it, AHEAD_CALLS calls' worth a worker).
PAST_BUDGET_LINES = AHEAD_CALLS * MAX_BATCH * WORKERS
FEEDER_KILLS = 3


@pytest.fixture(scope="module")
def model() -> str:
    return unique_queue("batch-money")


@pytest.fixture(scope="module")
def stack(
    start_stack: Callable[..., Stack], model: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    yield from priced_stack(
        start_stack, "batch-money", model, tmp_path_factory.mktemp("files"), workers=WORKERS,
        SAMPLING_MAX_BATCH_SIZE=str(MAX_BATCH), SAMPLING_FEEDER_LOCK_TTL_S=str(LOCK_TTL_S),
        SAMPLING_BATCH_MAX_ENQUEUED_LINES=str(ENQUEUED_LIMIT),
    )  # fmt: skip


def answered_bodies(client: OpenAI, batch: Any) -> list[dict[str, Any]]:
    return [r["response"]["body"] for r in records(client, batch.output_file_id)]


def test_a_key_over_its_budget_cannot_create_a_job(stack: Stack, model: str) -> None:
    _, _, client = new_key(stack, "--monthly-budget", "0")  # spent by the first answer

    def refused() -> bool:
        try:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])
        except openai.RateLimitError as refusal:
            return refusal.code == "insufficient_quota"
        return False

    wait_until(refused, timeout_s=15, what="the key refused for its budget")
    with pytest.raises(openai.RateLimitError) as refusal:
        create(client, chat_lines(model, 3, "over-budget"))
    assert (refusal.value.code, refusal.value.type) == ("insufficient_quota", "insufficient_quota")
    assert client.batches.list().data == []


def test_a_budget_crossed_mid_job_stops_its_lines_and_its_spend(stack: Stack, model: str) -> None:
    probe = chat_lines(model, 1, "priced-probe")[0]["body"]
    _, secret, first = new_key(stack)
    one = line_cost(first.chat.completions.create(**probe).model_dump())
    budget = one * 300  # about 300 lines' worth: less than a sixth of the job
    _, secret, client = new_key(stack, "--monthly-budget", str(budget))
    done = ended(client, create(client, chat_lines(model, LONG_JOB, "budget")).id, 120)
    assert done.status == "completed", done
    bodies = answered_bodies(client, done)
    errors = records(client, done.error_file_id)
    assert len(bodies) + len(errors) == LONG_JOB
    assert {e["response"]["body"]["error"]["code"] for e in errors} == {"insufficient_quota"}
    spent = sum((line_cost(body) for body in bodies), Decimal(0))
    assert budget <= spent < budget + one * PAST_BUDGET_LINES
    wait_until(lambda: usage_of(stack, secret, model).get("spend") == spent, timeout_s=15,
               what="the job's spend, exactly, in /v1/usage")  # fmt: skip


def test_a_key_revoked_mid_job_fails_its_lines_left(stack: Stack, model: str) -> None:
    name, _, client = new_key(stack)
    job = create(client, chat_lines(model, BIG_JOB, "revoked"))
    wait_until(lambda: completed(client.batches.retrieve(job.id)) > 0, 60, "the job under way")
    revoke = f"from operations.models import ApiKey; k = ApiKey.objects.get(name={name!r}); "
    manage(stack, "shell", "-c", revoke + "k.revoked = True; k.save()")
    # The key can read nothing any more: the job is read as an operator reads it.
    done = wait_until(lambda: (s := job_state(stack, job.id))["status"] == "completed" and s,
                      timeout_s=120, what="the job completed")  # fmt: skip
    assert 0 < done["completed"] < BIG_JOB
    assert done["failed"] == BIG_JOB - done["completed"]
    assert done["failed_with"] == [[401, "invalid_api_key"]]


def job_state(stack: Stack, job_id: str) -> dict[str, Any]:
    """A job's status and counts, and the distinct (status, code) of its failed lines, read
    from the database with `manage.py shell`."""
    script = (
        "import json; from offline.models import Job, JobLine; "
        f"j = Job.objects.get(id={job_id!r}); "
        "bad = {(l.status_code, l.body['error']['code']) "
        "for l in JobLine.objects.filter(job=j, answered=True).exclude(status_code=200)}; "
        "print(json.dumps({'status': j.status, 'completed': j.completed, 'failed': j.failed, "
        "'failed_with': sorted(bad)}))"
    )
    return dict(json.loads(manage(stack, "shell", "-c", script).strip().splitlines()[-1]))


def test_a_job_past_its_key_s_enqueued_lines_fails_validation(stack: Stack, model: str) -> None:
    _, _, client = new_key(stack)
    running = create(client, chat_lines(model, BIG_JOB, "enqueued"))
    # Over the limit while more than 1,000 of the running job's lines are unanswered.
    over_limit = chat_lines(model, ENQUEUED_LIMIT - 1000, "over-limit")
    over = ended(client, create(client, over_limit).id)
    assert over.status == "failed", over
    assert over.errors is not None
    assert over.errors.data
    assert over.errors.data[0].code == "token_limit_exceeded"
    assert ended(client, running.id, 120).status == "completed"
    alone = ended(client, create(client, chat_lines(model, ENQUEUED_LIMIT + 1, "alone")).id)
    assert alone.status == "failed", alone


def test_a_killed_feeder_loses_no_spend(stack: Stack, model: str) -> None:
    _, secret, client = new_key(stack)
    lines = chat_lines(model, LONG_JOB, "killed-feeder")
    job = create(client, lines)

    def past(lines: int) -> bool:
        return completed(client.batches.retrieve(job.id)) >= lines

    for kill in range(1, FEEDER_KILLS + 1):
        at_least = kill * LONG_JOB // (FEEDER_KILLS + 1)
        wait_until(functools.partial(past, at_least), 60, "the job under way")
        assert stack.feeder is not None
        os.kill(stack.feeder.pid, signal.SIGKILL)
        stack.feeder.wait(timeout=10)
        stack.start_feeder()
    done = ended(client, job.id, 120)
    assert done.status == "completed", done
    bodies = answered_bodies(client, done)
    assert len(bodies) == LONG_JOB
    spent = sum((line_cost(body) for body in bodies), Decimal(0))
    tokens = sum(body["usage"]["completion_tokens"] for body in bodies)

    def charged() -> bool:
        usage = usage_of(stack, secret, model)
        return usage.get("completion_tokens") == tokens and usage.get("spend") == spent

    wait_until(charged, timeout_s=15, what="the job's usage and spend, exactly, in /v1/usage")
