"""A new job's input file read through (the feeder's first step for each job): every line a
request of the job's endpoint (offline.lines.read_line), its custom_id unique, every line for
one model that serves completions. Then a JobLine per line and the job in_progress; or the
job failed, with what was wrong (OpenAI's `errors`: the first MAX_ERRORS).

A line whose body its endpoint would refuse (a bad setting, a prompt too long) is no error of
the job: it is answered as the endpoint would answer it, when it is fed.
"""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from offline.lines import BadLine, Line, kind_of, model_of, read_line
from offline.models import Job, JobLine, Status
from sampling.runtime import WebProcess

log = logging.getLogger(__name__)

MAX_ERRORS = 100
CREATE_CHUNK = 500


def checked(process: WebProcess, job: Job) -> None:
    """`run`, a failure to read the file failing the job (not the feeder's other jobs)."""
    try:
        run(process, job)
    except OSError as exc:
        log.exception("job %s: its input file cannot be read", job.id)
        job.errors = [_error(f"the input file cannot be read: {exc}")]
        job.save(update_fields=["errors", *job.mark(Status.FAILED, timezone.now())])


def run(process: WebProcess, job: Job) -> None:
    errors: list[dict[str, Any]] = []
    lines: list[Line] = []
    seen: set[str] = set()
    with job.input_file.content.open("rb") as handle:
        for raw in handle:
            if not raw.strip():
                continue
            index = len(lines) + len(errors)
            if index >= settings.SAMPLING_BATCH_MAX_LINES:
                errors.append(_error(f"more than {settings.SAMPLING_BATCH_MAX_LINES} lines"))
                break
            try:
                line = read_line(index, raw, job.endpoint)
            except BadLine as bad:
                errors.append(_error(str(bad), index))
                if len(errors) >= MAX_ERRORS:
                    break
                continue
            if line.custom_id in seen:
                errors.append(_error(f"custom_id {line.custom_id!r} is not unique", index))
                continue
            seen.add(line.custom_id)
            lines.append(line)
    model = ""
    if not errors:
        if not lines:
            errors.append(_error("the input file has no line"))
        else:
            model, problem = _model(process, lines, job.key_id, kind_of(job.endpoint))
            if problem:
                errors.append(_error(problem))
    now = timezone.now()
    if errors:
        job.errors = errors[:MAX_ERRORS]
        job.save(update_fields=["errors", *job.mark(Status.FAILED, now)])
        return
    # Each chunk its own short transaction: a long write transaction would hold SQLite's lock
    # from every other process. A validation cut short is done again from the start: its
    # lines are deleted first.
    JobLine.objects.filter(job=job).delete()
    for start in range(0, len(lines), CREATE_CHUNK):
        JobLine.objects.bulk_create(
            JobLine(job=job, line=line.index, custom_id=line.custom_id)
            for line in lines[start : start + CREATE_CHUNK]
        )
    with transaction.atomic():
        Job.objects.filter(id=job.id).update(model=model, total=len(lines))
        # Only a job still validating moves on: a cancel meanwhile stands.
        Job.objects.filter(id=job.id, status=Status.VALIDATING).update(
            status=Status.IN_PROGRESS, in_progress_at=now
        )
    job.refresh_from_db()


def _error(message: str, index: int | None = None) -> dict[str, Any]:
    return {"code": "invalid_line" if index is not None else "invalid_file", "message": message,
            "param": None, "line": index + 1 if index is not None else None}  # fmt: skip


def _model(process: WebProcess, lines: list[Line], key_id: int, kind: str) -> tuple[str, str]:
    """The one model the lines name (an alias resolved once, for the whole job), or why
    there is none."""
    names = {model_of(line) for line in lines}
    if len(names) != 1:
        return "", f"every line must name one model; they name {sorted(names)[:5]}"
    name = names.pop()
    catalog = process.catalog.current
    alias = catalog.aliases.get(name)
    if alias is not None:
        target = alias.pick(f"key:{key_id}")
        if target is None:
            return "", f"the model {name!r} has no target with a weight above 0"
        name = target
    entry = catalog.models.get(name)
    if entry is None:
        return "", f"the model {name!r} does not exist"
    if entry.kind != kind:
        return "", f"the model {name!r} is of kind {entry.kind}; the batch's endpoint needs {kind}"
    return name, ""
