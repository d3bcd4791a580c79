"""A feeder run's work on one model's lanes (offline.feeder): the answers collected into their
jobs' lines, and a job's next lines fed, read from where the last pass stopped."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from django.conf import settings

from batching.backfill import Backfill, BackfillItem, Done
from batching.catalog import Price
from offline import charges
from offline.lines import (
    BadLine,
    UnreadableLine,
    answered,
    raw_lines,
    read_line,
    refused,
    request_of,
)
from offline.models import Job, JobLine, Status
from serving.responses import Invalid
from serving.runtime import ServedModel

# Answers collected per shard and run at most.
COLLECT_AT_MOST = 5000
# Lines written in one transaction.
STEP = 100


def collect(
    lanes: Backfill,
    jobs: dict[str, Job],
    price_of: charges.PriceOf,
    charge: Callable[[Job], Any],
    count: Callable[[Job, charges.Settled], Any],
) -> int:
    """The lanes' answers into their lines (the first answer of each stays), at each job's
    price, each job's charge sent (`charge`) before the answers leave the lanes: a feeder
    fenced off on the way has charged what it wrote. Each step's lines are `count`ed (the
    model's offline statistics). Returns how many jobs had answers."""
    by_job: dict[str, dict[int, Done]] = defaultdict(dict)
    found, taken = lanes.collect(COLLECT_AT_MOST)
    for done in found:
        by_job[done.job].setdefault(done.line, done)
    written = 0
    for job_id, answers in by_job.items():
        job = jobs.get(job_id) or Job.objects.filter(id=job_id).first()
        if job is None or job.status not in (Status.IN_PROGRESS, Status.CANCELLING):
            continue  # gone, or finalized already: an answer that came twice
        lines = list(answers)
        for start in range(0, len(lines), STEP):
            step = {line: answered(job.endpoint, job.model, answers[line].answer)
                    for line in lines[start : start + STEP]}  # fmt: skip
            count(job, charges.settle(job, step, price_of(job)))
        charge(job)
        written += 1
    lanes.acknowledge(taken)  # off the lanes once written: a failure before reads them again
    return written


def feed(lanes: Backfill, model: ServedModel, job: Job, at_most: int) -> int:
    """Push up to `at_most` of the job's next lines (those not answered yet) onto the lanes;
    a line its endpoint refuses is answered at once. Returns how many were pushed."""
    policy = model.watcher.current
    items: list[BackfillItem] = []
    refusals: dict[int, tuple[int, dict[str, Any]]] = {}
    offset, first = job.fed_offset, job.fed_lines
    window = 2 * at_most  # lines looked at this run: a job fed again skips its answered ones
    unanswered = _unanswered(job, first, window)
    index = first
    with job.input_file.content.open("rb") as handle:
        handle.seek(offset)
        # Line by line from the offset (a File's own iteration reads again from byte 0).
        for raw, size in raw_lines(handle, settings.SAMPLING_BATCH_MAX_LINE_BYTES):
            offset += size
            if raw is not None and not raw.strip():
                continue
            if index in unanswered:
                try:
                    if raw is None:
                        raise BadLine("over the size limit")
                    line = read_line(index, raw, job.endpoint)
                    request = request_of(line, job.endpoint, policy)
                    items.append(BackfillItem(job.id, index, request))
                except Invalid as invalid:
                    refusals[index] = refused(invalid)
                except (BadLine, UnreadableLine):  # validated before: the file changed
                    refusals[index] = refused(Invalid("the line changed after validation"))
            index += 1
            if len(items) >= at_most or index >= first + window or index >= job.total:
                break
    pushed = lanes.push(items)
    if refusals:
        charges.settle(job, refusals, Price())  # refusals cost nothing
    job.fed_offset, job.fed_lines = offset, index
    job.save(update_fields=["fed_offset", "fed_lines"])
    return pushed


def _unanswered(job: Job, first: int, count: int) -> set[int]:
    lines = JobLine.objects.filter(job=job, line__gte=first, line__lt=first + count,
                                   answered=False).values_list("line", flat=True)  # fmt: skip
    return set(lines)
