"""Offline jobs moved on, off the request path: one web process of the deployment at a time
(a Redis lock, renewed on each run) runs `tick` every FEED_INTERVAL_S:

1. validating jobs: the input file read through (offline.validate); in_progress, or failed;
2. answers collected from the backfill lanes of every model with a job: each line keeps its
   first answer (JobLine), and its job's counts follow;
3. items taken longer than SAMPLING_BACKFILL_TAKEN_TIMEOUT_S ago put back (their worker
   died); after Redis lost the lanes (a restart: a shard's epoch key is gone), each job's
   unanswered lines fed again;
4. in_progress jobs fed, oldest first, until each model's lanes hold AHEAD_CALLS calls' worth
   per live worker (an idle farm never waits for the next run);
5. jobs with every line answered finalized (offline.finish); a cancelled or expired job's
   items withdrawn, and once none is still in a call, finalized with what is done.

The feeder is a web process's loop, not a process of its own: nothing more to deploy, and the
process that holds the lock feeds every model (docs/guides/batch.md).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import defaultdict
from typing import Any

import redis
from django.conf import settings
from django.db import close_old_connections, transaction
from django.db.models import F
from django.utils import timezone
from redis.exceptions import LockError

from batching.answers import Answer
from batching.backfill import Backfill, BackfillItem, Done
from batching.keys import QueueKeys
from offline import finish, validate
from offline.lines import BadLine, answered, read_line, refused, request_of
from offline.models import Job, JobLine, Status
from offline.yielding import let_requests_run
from sampling.responses import Invalid
from sampling.runtime import ServedModel, WebProcess

log = logging.getLogger(__name__)

FEED_INTERVAL_S = 0.25
# The lock outlives a run by far (a file of 50,000 lines validates in a few seconds): two
# feeders at once would trim each other's answers. A dead holder's lock expires after this.
LOCK_TTL_S = 60.0
# Items kept waiting per live worker of a model: this many of its calls' worth.
AHEAD_CALLS = 8
# Answers collected per shard and run at most.
COLLECT_AT_MOST = 5000
# Lines written, or read and checked, between two yields to the process's requests.
STEP = 20


class Feeder:
    def __init__(self, process: WebProcess) -> None:
        self.process = process
        self.client = process.client
        self.lock = self.client.lock(
            QueueKeys(process.default_model).feeder_lock, timeout=LOCK_TTL_S, blocking=False
        )
        self.held = False

    def tick(self) -> None:
        if not self._hold():
            return
        try:
            moving = [Status.VALIDATING, Status.IN_PROGRESS, Status.CANCELLING]
            jobs = list(Job.objects.filter(status__in=moving).order_by("created"))
            for job in jobs:
                if job.status == Status.VALIDATING:
                    validate.checked(self.process, job)
            by_model: dict[str, list[Job]] = defaultdict(list)
            for job in jobs:
                if job.status == Status.CANCELLING and not job.model:  # before it had lines
                    finish.finalize(job, Status.CANCELLED)
                elif job.status != Status.VALIDATING and job.model:
                    by_model[job.model].append(job)
            for model, model_jobs in by_model.items():
                self._move_on(self.process.model(model), model_jobs)
        finally:
            close_old_connections()

    def _hold(self) -> bool:
        """Whether this process holds the feeder's lock (taken, or renewed)."""
        try:
            if self.held:
                self.lock.reacquire()
            else:
                self.held = bool(self.lock.acquire(token=secrets.token_hex(8)))
        except LockError:  # lost it (it expired: this process stalled): another may feed
            self.held = False
        return self.held

    def _move_on(self, model: ServedModel, jobs: list[Job]) -> None:
        lanes = Backfill(self.client, model.aggregator.shards)
        epoch = self._epoch(model)
        collect(lanes, {job.id: job for job in jobs})
        timeout_ms = round(settings.SAMPLING_BACKFILL_TAKEN_TIMEOUT_S * 1000)
        lanes.requeue_stale(int(time.time() * 1000), timeout_ms)
        now = timezone.now()
        waiting, _ = lanes.depth()
        live = model.aggregator.workers.live_count()
        room = max(0, AHEAD_CALLS * model.watcher.current.max_batch_size * max(1, live) - waiting)
        for job in jobs:
            job.refresh_from_db()
            if job.status == Status.IN_PROGRESS and now >= job.expires_at:
                job.save(update_fields=job.mark(Status.CANCELLING, now))  # expiring
            if job.status == Status.CANCELLING:
                self._wind_down(lanes, job)
            elif job.status == Status.IN_PROGRESS:
                if job.epoch != epoch:  # the lanes were lost since it was fed: again
                    job.fed_lines, job.fed_offset, job.epoch = 0, 0, epoch
                    job.save(update_fields=["fed_lines", "fed_offset", "epoch"])
                if room > 0:
                    room -= feed(lanes, model, job, room)
                if job.completed + job.failed >= job.total:
                    finish.finalize(job, Status.COMPLETED)

    def _epoch(self, model: ServedModel) -> str:
        """The lanes' epoch: each shard's token (written where missing: Redis lost it)."""
        with self.client.pipeline(transaction=False) as pipe:
            for keys in model.aggregator.shards:
                pipe.set(keys.backfill_epoch, secrets.token_hex(6), nx=True)
                pipe.get(keys.backfill_epoch)
            replies = pipe.execute()
        return "|".join((token or b"").decode() for token in replies[1::2])

    def _wind_down(self, lanes: Backfill, job: Job) -> None:
        """A cancelled (or expired) job: its waiting items out of the lanes, and once none is
        in a call any more, its lines done so far written."""
        _, still_taken = lanes.withdraw(job.id)
        if still_taken:
            return
        expired = job.cancelling_at is not None and job.cancelling_at >= job.expires_at
        finish.finalize(job, Status.EXPIRED if expired else Status.CANCELLED)


def collect(lanes: Backfill, jobs: dict[str, Job]) -> int:
    """The lanes' answers into their lines (the first answer of each stays); returns how
    many lines were answered."""
    by_job: dict[str, dict[int, Done]] = defaultdict(dict)
    found, taken = lanes.collect(COLLECT_AT_MOST)
    for done in found:
        by_job[done.job].setdefault(done.line, done)
    count = 0
    for job_id, answers in by_job.items():
        job = jobs.get(job_id) or Job.objects.filter(id=job_id).first()
        if job is None or job.status not in (Status.IN_PROGRESS, Status.CANCELLING):
            continue  # gone, or finalized already: an answer that came twice
        count += _answer_lines(job, {line: d.answer for line, d in answers.items()})
    lanes.acknowledge(taken)  # off the lanes once written: a failure before reads them again
    return count


def _answer_lines(job: Job, answers: dict[int, Answer]) -> int:
    count = 0
    lines = list(answers)
    for start in range(0, len(lines), STEP):
        step = {line: answered(job.endpoint, job.model, answers[line])
                for line in lines[start : start + STEP]}  # fmt: skip
        count += _settle(job, step)
        let_requests_run()
    return count


def _settle(job: Job, outcomes: dict[int, tuple[int, dict[str, Any]]]) -> int:
    """Lines answered (status, body), those not answered before only; the job's counts
    raised by them, in the same transaction (no count over its lines: one feeder at a time,
    so what it raises is exact). Returns how many lines it answered."""
    with transaction.atomic():
        rows = list(JobLine.objects.filter(job=job, line__in=list(outcomes), answered=False))
        for row in rows:
            row.status_code, row.body = outcomes[row.line]
            row.answered = True
        JobLine.objects.bulk_update(rows, ["answered", "status_code", "body"])
        ok = sum(1 for row in rows if row.ok)
        Job.objects.filter(id=job.id).update(
            completed=F("completed") + ok, failed=F("failed") + len(rows) - ok
        )
    return len(rows)


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
        for raw in handle:
            offset += len(raw)
            if not raw.strip():
                continue
            if index in unanswered:
                try:
                    line = read_line(index, raw, job.endpoint)
                    request = request_of(line, job.endpoint, policy)
                    items.append(BackfillItem(job.id, index, request))
                except Invalid as invalid:
                    refusals[index] = refused(invalid)
                except BadLine:  # validated before: the file changed under the job
                    refusals[index] = refused(Invalid("the line changed after validation"))
            index += 1
            if index % STEP == 0:
                let_requests_run()
            if len(items) >= at_most or index >= first + window or index >= job.total:
                break
    pushed = lanes.push(items)
    if refusals:
        _settle(job, refusals)
    job.fed_offset, job.fed_lines = offset, index
    job.save(update_fields=["fed_offset", "fed_lines"])
    return pushed


def _unanswered(job: Job, first: int, count: int) -> set[int]:
    lines = JobLine.objects.filter(job=job, line__gte=first, line__lt=first + count,
                                   answered=False).values_list("line", flat=True)  # fmt: skip
    return set(lines)


_feeders: dict[int, Feeder] = {}


def run(process: WebProcess) -> None:
    """The process loop's job (offline.apps)."""
    feeder = _feeders.get(id(process))
    if feeder is None:
        feeder = _feeders[id(process)] = Feeder(process)
    try:
        feeder.tick()
    except redis.RedisError:
        feeder.held = False
        raise
