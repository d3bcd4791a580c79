"""A new job's input file read through (the feeder's first step for each job): every line a
request of the job's endpoint (offline.lines.read_line), its custom_id unique, every line for
one model that serves completions. Then a JobLine per line and the job in_progress; or the
job failed, with what was wrong (OpenAI's `errors`: the first MAX_ERRORS).

A line whose body its endpoint would refuse (a bad setting, a prompt too long) is no error of
the job: it is answered as the endpoint would answer it, when it is fed. Nor is a line no
request can be read from (over SAMPLING_BATCH_MAX_LINE_BYTES, nested deeper than
offline.lines.MAX_LINE_DEPTH, not UTF-8, a NUL character): it is answered at once with a 400
that says why, and never fed.
"""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.db import DatabaseError, transaction
from django.db.models import F, Sum
from django.utils import timezone
from redis.exceptions import RedisError

from batching.catalog import Price
from offline.failures import count_failure
from offline.lines import (
    BadLine,
    Line,
    UnreadableLine,
    kind_of,
    model_of,
    raw_lines,
    read_line,
    refused,
)
from offline.models import Job, JobLine, Status
from serving.responses import Invalid
from serving.routing import key_sticky
from serving.runtime import WebProcess

log = logging.getLogger(__name__)

MAX_ERRORS = 100
# The statuses whose jobs' unanswered lines count against their key's enqueued limit.
ENQUEUED = (Status.IN_PROGRESS, Status.CANCELLING, Status.FINALIZING)
CREATE_CHUNK = 500


def checked(process: WebProcess, job: Job) -> None:
    """`run`, a failure of this job's own failing the job (not the feeder's other jobs). A
    database or Redis failure is the feeder's: it is raised, and the next run tries again."""
    try:
        run(process, job)
    except (DatabaseError, RedisError):
        raise
    except Exception as exc:  # the file cannot be read, or a line breaks what reads it
        log.exception("job %s: its input file cannot be validated", job.id)
        count_failure("validated")
        _fail(job, [_error(f"the input file cannot be validated: {type(exc).__name__}")])


def run(process: WebProcess, job: Job) -> None:
    lines, unreadable, errors = _read(job)
    model = via = ""
    if not errors:
        if not lines:
            errors.append(_error("the input file has no readable line"))
        else:
            model, via, problem = _model(process, lines, job.key_id, kind_of(job.endpoint))
            if problem:
                errors.append(_error(problem))
            elif over := _over_enqueued(job, model, len(lines)):  # unreadable lines never wait
                errors.append(over)
    now = timezone.now()
    if errors:
        _fail(job, errors[:MAX_ERRORS])
        return
    # Each chunk its own short transaction: a long write transaction would hold SQLite's lock
    # from every other process. A validation cut short is done again: the lines it wrote stay
    # (the same rows), and one made by a feeder that stalled past its lock while its successor
    # validated and ran the job changes nothing: a line's row is never deleted nor replaced.
    for start in range(0, len(lines), CREATE_CHUNK):
        JobLine.objects.bulk_create(
            (JobLine(job=job, line=line.index, custom_id=line.custom_id)
             for line in lines[start : start + CREATE_CHUNK]),
            ignore_conflicts=True,
        )  # fmt: skip
    _answer_unreadable(job, unreadable)
    entry = process.catalog.current.models.get(model)  # priced once, for every line
    price = entry.batch_price if entry is not None else Price()
    with transaction.atomic():
        # Only a job no one validated yet (a stalled feeder's late run changes nothing).
        validated = Job.objects.filter(id=job.id, model="").update(
            model=model, alias=via, total=len(lines) + len(unreadable), failed=len(unreadable),
            prompt_price_nanos=price.prompt_nanos, completion_price_nanos=price.completion_nanos,
        )  # fmt: skip
        if not validated:
            log.warning("job %s was validated meanwhile (by another feeder)", job.id)
            job.refresh_from_db()
            return
        # Only a job still validating moves on: a cancel meanwhile stands.
        Job.objects.filter(id=job.id, status=Status.VALIDATING).update(
            status=Status.IN_PROGRESS, in_progress_at=now
        )
    job.refresh_from_db()


def _fail(job: Job, errors: list[dict[str, Any]]) -> None:
    """The job failed with `errors`, if it is still validating and no one validated it: a
    feeder that stalled past its lock while its successor validated and ran the job (the
    catalog, the key's other jobs or the file changed since) leaves it as it is."""
    job.errors = errors
    fields = ["errors", *job.mark(Status.FAILED, timezone.now())]
    if not job.saved_where(fields, status=Status.VALIDATING, model=""):
        log.warning("job %s was validated or cancelled meanwhile: not failed", job.id)
    job.refresh_from_db()


def _read(job: Job) -> tuple[list[Line], dict[int, tuple[str, str]], list[dict[str, Any]]]:
    """The input's lines read through: the requests, the lines that are their own error (by
    index: why, and their custom_id or ""), and the errors that fail the job."""
    errors: list[dict[str, Any]] = []
    lines: list[Line] = []
    unreadable: dict[int, tuple[str, str]] = {}
    seen: set[str] = set()
    limit = settings.SAMPLING_BATCH_MAX_LINE_BYTES
    with job.input_file.content.open("rb") as handle:
        for raw, _ in raw_lines(handle, limit):
            if raw is not None and not raw.strip():
                continue
            index = len(lines) + len(errors) + len(unreadable)
            if index >= settings.SAMPLING_BATCH_MAX_LINES:
                errors.append(_error(f"more than {settings.SAMPLING_BATCH_MAX_LINES} lines"))
                break
            line = None
            try:
                if raw is None:
                    raise UnreadableLine(f"line {index + 1} is over the {limit}-byte limit")
                line = read_line(index, raw, job.endpoint)
                custom_id = line.custom_id
            except UnreadableLine as unread:  # kept as text: the exception holds the line
                custom_id = unread.custom_id
                why = str(unread)
            except BadLine as bad:
                errors.append(_error(str(bad), index))
                if len(errors) >= MAX_ERRORS:
                    break
                continue
            if custom_id in seen:
                errors.append(_error(f"custom_id {custom_id!r} is not unique", index))
                continue
            if custom_id:
                seen.add(custom_id)
            if line is None:
                unreadable[index] = (why, custom_id)
            else:
                lines.append(line)
    return lines, unreadable, errors


def _answer_unreadable(job: Job, unreadable: dict[int, tuple[str, str]]) -> None:
    """The lines no request could be read from, answered at once with a 400 that says why:
    never fed, in the job's error file."""
    rows = [
        JobLine(job=job, line=index, custom_id=custom_id, answered=True,
                status_code=status, body=body)
        for index, (why, custom_id) in unreadable.items()
        for status, body in [refused(Invalid(why, code="invalid_line"))]
    ]  # fmt: skip
    for start in range(0, len(rows), CREATE_CHUNK):
        JobLine.objects.bulk_create(rows[start : start + CREATE_CHUNK], ignore_conflicts=True)


def _error(message: str, index: int | None = None) -> dict[str, Any]:
    return {"code": "invalid_line" if index is not None else "invalid_file", "message": message,
            "param": None, "line": index + 1 if index is not None else None}  # fmt: skip


def _over_enqueued(job: Job, model: str, lines: int) -> dict[str, Any] | None:
    """OpenAI's error when the key's jobs in progress would hold more unanswered lines than
    SAMPLING_BATCH_MAX_ENQUEUED_LINES with this job's; None when they fit."""
    limit = settings.SAMPLING_BATCH_MAX_ENQUEUED_LINES
    others = Job.objects.filter(key_id=job.key_id, status__in=ENQUEUED).exclude(id=job.id)
    left = others.aggregate(left=Sum(F("total") - F("completed") - F("failed")))["left"] or 0
    if left + lines <= limit:
        return None
    message = (
        f"Enqueued line limit reached for {model} for this API key. Limit: {limit:,} enqueued "
        f"lines; {left:,} are enqueued, and this batch has {lines:,}. Please try again once "
        "some in_progress batches have been completed."
    )
    return {"code": "token_limit_exceeded", "message": message, "param": None, "line": None}


def _model(process: WebProcess, lines: list[Line], key_id: int, kind: str) -> tuple[str, str, str]:
    """The one model the lines name, the alias they named it through ("" for none) and why
    there is none. An alias resolves to the key's target now; each feed pass resolves it again
    (offline.feeder), so a job follows its alias's split."""
    names = {model_of(line) for line in lines}
    if len(names) != 1:
        return "", "", f"every line must name one model; they name {sorted(names)[:5]}"
    name = names.pop()
    catalog = process.catalog.current
    alias = catalog.aliases.get(name)
    via = ""
    if alias is not None:
        target = alias.pick(key_sticky(key_id))
        if target is None:
            return "", "", f"the model {name!r} has no target with a weight above 0"
        via, name = name, target
    entry = catalog.models.get(name)
    if entry is None:
        return "", "", f"the model {name!r} does not exist"
    if entry.kind != kind:
        problem = f"the model {name!r} is of kind {entry.kind}; the batch's endpoint needs {kind}"
        return "", "", problem
    return name, via, ""
