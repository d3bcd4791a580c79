"""A feeder that stalled past its lock (SIGSTOP, a paused machine) and resumes in the middle
of a run, against Django's test database: its validation of a job its successor validated
and ran since changes nothing (no answered line lost, no count reset), and its finalization
of a job its successor ended leaves the job as it ended (same files, no second set)."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from typing import Any, cast

import pytest
from django.core.files.base import ContentFile
from django.utils import timezone

from batching.catalog import Catalog, ModelEntry
from offline import finish, validate
from offline.models import Job, JobLine, Status, StoredFile
from tests.support.batches import chat_lines, jsonl

pytestmark = pytest.mark.django_db

MODEL = "fenced"
LINES = 7
KEY = 43


def _process() -> Any:
    catalog = Catalog.of([ModelEntry(MODEL, prompt_price="0.001", completion_price="0.002")])
    return cast(Any, SimpleNamespace(catalog=SimpleNamespace(current=catalog)))


def _job() -> Job:
    content = jsonl(chat_lines(MODEL, LINES, "fenced"))
    stored = StoredFile(key_id=KEY, purpose="batch", filename="in.jsonl", size=len(content),
                        lines=LINES)  # fmt: skip
    stored.content.save("in.jsonl", ContentFile(content), save=True)
    return Job.objects.create(key_id=KEY, endpoint="/v1/chat/completions", input_file=stored,
                              expires_at=timezone.now() + timedelta(hours=1))  # fmt: skip


def _answer(job: Job, lines: range) -> None:
    JobLine.objects.filter(job=job, line__in=list(lines)).update(
        answered=True, status_code=200, body={"usage": {"prompt_tokens": 1}}
    )
    Job.objects.filter(id=job.id).update(completed=len(lines))


def test_a_stalled_feeders_late_validation_changes_nothing() -> None:
    job = _job()
    stale = Job.objects.get(id=job.id)  # read by the feeder that stalls, while validating
    validate.run(_process(), job)  # its successor validates it...
    job.refresh_from_db()
    assert (job.status, job.model, job.total) == (Status.IN_PROGRESS, MODEL, LINES)
    _answer(job, range(3))  # ...and runs it
    validate.run(_process(), stale)  # the stalled one resumes
    job.refresh_from_db()
    assert (job.status, job.total, job.completed, job.failed) == (Status.IN_PROGRESS, LINES, 3, 0)
    answered = JobLine.objects.filter(job=job, answered=True).values_list("line", flat=True)
    assert sorted(answered) == [0, 1, 2]
    assert JobLine.objects.filter(job=job).count() == LINES


def test_a_stalled_feeders_late_finalization_leaves_the_ended_job_as_it_is() -> None:
    job = _job()
    validate.run(_process(), job)
    job.refresh_from_db()
    _answer(job, range(LINES))
    stale = Job.objects.get(id=job.id)  # read by the feeder that stalls, before it finalizes
    finish.finalize(job, Status.COMPLETED)  # its successor finalizes it
    ended = Job.objects.get(id=job.id)
    assert (ended.status, ended.completed) == (Status.COMPLETED, LINES)
    files = StoredFile.objects.count()
    finish.finalize(stale, Status.COMPLETED)  # the stalled one resumes
    again = Job.objects.get(id=job.id)
    assert (again.status, again.output_file_id, again.completed_at) == (
        Status.COMPLETED, ended.output_file_id, ended.completed_at,
    )  # fmt: skip
    assert StoredFile.objects.count() == files


def test_a_stalled_feeders_late_validation_fails_no_running_job() -> None:
    """What the stalled feeder finds wrong now (the model left the catalog, the file gone)
    is not the running job's failure."""
    job = _job()
    stale = Job.objects.get(id=job.id)
    validate.run(_process(), job)
    _answer(job, range(3))
    gone = cast(Any, SimpleNamespace(catalog=SimpleNamespace(current=Catalog.of([]))))
    validate.checked(gone, stale)
    job.input_file.content.delete(save=False)
    validate.checked(_process(), stale)
    job.refresh_from_db()
    assert (job.status, job.errors, job.completed) == (Status.IN_PROGRESS, None, 3)
