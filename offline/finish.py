"""A job's end: its output file (the lines answered 200) and error file (every other line)
written in OpenAI's shape, one line per custom_id, in the input's order; its status
completed, cancelled or expired. A line never answered (the job cancelled or expired first)
goes to the error file with the job's reason. The feeder finalizes again a job it finds
finalizing: the last attempt was cut short.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from django.core.files.base import ContentFile
from django.db import transaction
from django.utils import timezone

from offline.models import Job, JobLine, Purpose, Status, StoredFile

# The statuses of a job that has not ended yet: what may be finalized.
MOVING = (Status.IN_PROGRESS, Status.CANCELLING, Status.FINALIZING)
# Why a line has no answer, by the job's end.
UNANSWERED = {
    Status.CANCELLED: ("batch_cancelled", "the batch was cancelled before this request ran"),
    Status.EXPIRED: ("batch_expired", "the batch expired before this request ran"),
    Status.COMPLETED: ("batch_failed", "this request was never answered"),
}


def ending_of(job: Job) -> Status:
    """Where a job that stopped moving ends: completed, or once cancelling, cancelled or
    expired (cancelling from its expiry on)."""
    if job.cancelling_at is None:
        return Status.COMPLETED
    return Status.EXPIRED if job.cancelling_at >= job.expires_at else Status.CANCELLED


def finalize(job: Job, status: Status) -> None:
    """The job's files written whole from its lines, then its end `status`. Idempotent: a
    job left finalizing (its feeder killed, a write failed) is finalized again from its lines;
    a file of the broken attempt may stay in storage, unreferenced. A job that ended already
    (finalized by another feeder while this one stalled) is left as it is."""
    if not job.saved_where(job.mark(Status.FINALIZING, timezone.now()), status__in=MOVING):
        job.refresh_from_db()
        return
    outputs: list[bytes] = []
    errors: list[bytes] = []
    # In chunks read whole: no cursor left open (a reader holds SQLite's shared lock, and
    # every writer waits for it).
    first = 0
    while chunk := list(JobLine.objects.filter(job=job, line__gte=first).order_by("line")[:500]):
        for row in chunk:
            (outputs if row.answered and row.ok else errors).append(_line(job, row, status))
        first = chunk[-1].line + 1
    with transaction.atomic():
        job.output_file = _store(job, "output", outputs) if outputs else None
        job.error_file = _store(job, "errors", errors) if errors else None
        job.completed = sum(1 for _ in outputs)
        job.failed = len(errors)
        fields = [
            "output_file",
            "error_file",
            "completed",
            "failed",
            *job.mark(status, timezone.now()),
        ]
        ended = job.saved_where(fields, status=Status.FINALIZING)
        if not ended:  # ended meanwhile by another feeder: its files stand
            transaction.set_rollback(True)
    if not ended:
        for stored in (job.output_file, job.error_file):
            if stored is not None:
                stored.content.delete(save=False)
        job.refresh_from_db()


def _line(job: Job, row: JobLine, status: Status) -> bytes:
    record: dict[str, Any] = {
        "id": f"batch_req_{secrets.token_hex(12)}",
        "custom_id": row.custom_id or None,  # none could be read from an unreadable line
    }
    if row.answered and row.status_code is not None:
        request_id = f"req_{secrets.token_hex(12)}"
        record["response"] = {
            "status_code": row.status_code,
            "request_id": request_id,
            "body": row.body,
        }
        record["error"] = None
    else:
        code, message = UNANSWERED[status]
        record["response"] = None
        record["error"] = {"code": code, "message": message}
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def _store(job: Job, kind: str, lines: list[bytes]) -> StoredFile:
    content = b"".join(lines)
    stored = StoredFile(key_id=job.key_id, purpose=Purpose.BATCH_OUTPUT, size=len(content),
                        lines=len(lines), filename=f"{job.id}_{kind}.jsonl")  # fmt: skip
    stored.content.save(f"{stored.id}.jsonl", ContentFile(content), save=False)
    stored.save()
    return stored
