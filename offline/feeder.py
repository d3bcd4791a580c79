"""Offline jobs moved on, off the request path: the feeder process (`python manage.py
runfeeder`: `serve`), one of the deployment's at a time (a Redis lock, renewed on each run),
runs `tick` every FEED_INTERVAL_S:

1. validating jobs: the input file read through (offline.validate); in_progress, or failed;
2. answers collected from the backfill lanes of every model with a job: each line keeps its
   first answer (JobLine), and its job's counts follow;
3. items taken longer than SAMPLING_BACKFILL_TAKEN_TIMEOUT_S ago put back (their worker
   died); after Redis lost the lanes (a restart: a shard's epoch key is gone), each job's
   unanswered lines fed again;
4. in_progress jobs fed until each model's lanes hold AHEAD_CALLS calls' worth per live
   worker (an idle farm never waits for the next run), the room dealt evenly to the keys with
   a job, each key's jobs oldest first;
5. jobs with every line answered finalized (offline.finish); a cancelled or expired job's
   items withdrawn, and once none is still in a call, finalized with what is done; a job
   left finalizing (its run cut short) finalized again.

A job's step that fails is logged and the run goes on with the other jobs.

The process that holds the lock feeds every model (docs/guides/batch.md). It runs at the
lowest CPU priority (NICENESS): its work (files, the database, JSON) must never take a core
from the requests it may share a machine with. As a loop of a gevent web process it held that
process's requests for each database write, and as a process of normal priority it competed
with them: either way the requests' p99 at half load read ~20% higher (`bench backfill`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from django.conf import settings
from django.db import close_old_connections, transaction
from django.db.models import F
from django.utils import timezone
from redis.exceptions import LockError

from batching.answers import Answer
from batching.backfill import Backfill, BackfillItem, Done
from batching.catalog import Price
from batching.keys import QueueKeys
from batching.loop import PeriodicLoop
from offline import finish, validate
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
from sampling.responses import Invalid
from sampling.runtime import ServedModel, WebProcess, flush_on_exit, web_process

log = logging.getLogger(__name__)

FEED_INTERVAL_S = 0.25
# The lock outlives a run by far (a file of 50,000 lines validates in a few seconds): two
# feeders at once would trim each other's answers. A dead holder's lock expires after this.
LOCK_TTL_S = 60.0
# Items kept waiting per live worker of a model: this many of its calls' worth (2 s of an
# idle GPU: a worker that finds the lane empty takes none until its next heartbeat, so a
# feeder's slow run must not empty it).
AHEAD_CALLS = 20
# Answers collected per shard and run at most.
COLLECT_AT_MOST = 5000
# Lines written in one transaction.
STEP = 100
# The feeder process's niceness: the lowest CPU priority.
NICENESS = 19

# Charges a job's key with tokens of its lines just written: (job, prompt, completion).
Charge = Callable[[Job, int, int], None]


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
            moving = [Status.VALIDATING, Status.IN_PROGRESS, Status.CANCELLING, Status.FINALIZING]
            jobs = list(Job.objects.filter(status__in=moving).order_by("created"))
            for job in jobs:
                if job.status == Status.VALIDATING:
                    _alone(job.id, "validated", validate.checked, self.process, job)
                elif job.status == Status.FINALIZING:  # the last attempt was cut short
                    _alone(job.id, "finalized", finish.finalize, job, finish.ending_of(job))
            by_model: dict[str, list[Job]] = defaultdict(list)
            for job in jobs:
                if job.status == Status.CANCELLING and not job.model:  # before it had lines
                    _alone(job.id, "finalized", finish.finalize, job, Status.CANCELLED)
                elif job.status in (Status.IN_PROGRESS, Status.CANCELLING) and job.model:
                    by_model[job.model].append(job)
            for model, model_jobs in by_model.items():
                self._move_on(self.process.model(model), model_jobs)
        finally:
            close_old_connections()

    def release(self) -> None:
        if self.held:
            with contextlib.suppress(LockError, redis.RedisError):  # gone: it lapses
                self.lock.release()
            self.held = False

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
        collect(lanes, {job.id: job for job in jobs}, self._charge)
        timeout_ms = round(settings.SAMPLING_BACKFILL_TAKEN_TIMEOUT_S * 1000)
        lanes.requeue_stale(int(time.time() * 1000), timeout_ms)
        waiting, _ = lanes.depth()
        live = model.aggregator.workers.live_count()
        room = max(0, AHEAD_CALLS * model.watcher.current.max_batch_size * max(1, live) - waiting)
        # The room dealt evenly to the keys with a job to feed, each key's jobs oldest first:
        # one tenant's long job cannot hold another's back until it is all fed.
        keys = {job.key_id for job in jobs if job.status == Status.IN_PROGRESS}
        share = dict.fromkeys(keys, max(1, room // max(1, len(keys))))
        for job in jobs:
            at_most = min(room, share.get(job.key_id, room))
            fed = _alone(job.id, "moved on", self._move_job_on, lanes, model, job, epoch, at_most)
            room -= fed
            if job.key_id in share:
                share[job.key_id] -= fed

    def _move_job_on(
        self, lanes: Backfill, model: ServedModel, job: Job, epoch: str, room: int
    ) -> int:
        """One job of `model` expired, wound down, fed up to `room` lines or finalized; how
        many lines it fed."""
        now, fed = timezone.now(), 0
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
                fed = feed(lanes, model, job, room)
            if job.completed + job.failed >= job.total:
                finish.finalize(job, Status.COMPLETED)
        return fed

    def _charge(self, job: Job, prompt_tokens: int, completion_tokens: int) -> None:
        """A job's new tokens charged to its key, as a request's are (usage and spend, at
        its model's batch price: ModelEntry.batch_price), flushed with the process's
        statistics."""
        entry = self.process.catalog.current.models.get(job.model)
        price = entry.batch_price if entry is not None else Price()
        spend = price.of(prompt_tokens, completion_tokens)
        self.process.model(job.model).stats.record_usage(
            job.key_id, prompt_tokens, completion_tokens, 0, spend_nanos=spend
        )

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
        if not still_taken:
            finish.finalize(job, finish.ending_of(job))


def _alone(job_id: str, what: str, step: Callable[..., Any], *args: Any) -> Any:
    """`step(*args)` for one job: its failure logged, each time, and the run goes on with the
    other jobs (0 for it). Redis away fails the whole run: every job needs it."""
    try:
        return step(*args)
    except redis.RedisError:
        raise
    except Exception:
        log.exception("job %s could not be %s; the next run tries again", job_id, what)
        return 0


def collect(lanes: Backfill, jobs: dict[str, Job], charge: Charge) -> int:
    """The lanes' answers into their lines (the first answer of each stays), each job's new
    tokens charged (`charge`) once they are written; returns how many lines were answered."""
    by_job: dict[str, dict[int, Done]] = defaultdict(dict)
    found, taken = lanes.collect(COLLECT_AT_MOST)
    for done in found:
        by_job[done.job].setdefault(done.line, done)
    count = 0
    for job_id, answers in by_job.items():
        job = jobs.get(job_id) or Job.objects.filter(id=job_id).first()
        if job is None or job.status not in (Status.IN_PROGRESS, Status.CANCELLING):
            continue  # gone, or finalized already: an answer that came twice
        count += _answer_lines(job, {line: d.answer for line, d in answers.items()}, charge)
    lanes.acknowledge(taken)  # off the lanes once written: a failure before reads them again
    return count


def _answer_lines(job: Job, answers: dict[int, Answer], charge: Charge) -> int:
    settled = Settled()
    lines = list(answers)
    for start in range(0, len(lines), STEP):
        step = {line: answered(job.endpoint, job.model, answers[line])
                for line in lines[start : start + STEP]}  # fmt: skip
        settled += _settle(job, step)
    if settled.prompt_tokens or settled.completion_tokens:
        charge(job, settled.prompt_tokens, settled.completion_tokens)
    return settled.lines


@dataclass
class Settled:
    """Lines answered by one `_settle` (or several, added up), and their 200s' tokens."""

    lines: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def __iadd__(self, other: Settled) -> Settled:
        self.lines += other.lines
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        return self


def _tokens(status: int, body: dict[str, Any]) -> tuple[int, int]:
    """A line's tokens, as its body's usage reports them (an embedding's: prompt tokens)."""
    usage = body.get("usage") if status == 200 else None
    if not usage:
        return 0, 0
    return int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))


def _settle(job: Job, outcomes: dict[int, tuple[int, dict[str, Any]]]) -> Settled:
    """Lines answered (status, body), those not answered before only; the job's counts and
    tokens raised by them, in the same transaction (no count over its lines: one feeder at a
    time, so what it raises is exact)."""
    with transaction.atomic():
        rows = list(JobLine.objects.filter(job=job, line__in=list(outcomes), answered=False))
        settled = Settled(len(rows))
        for row in rows:
            row.status_code, row.body = outcomes[row.line]
            row.answered = True
            prompt, completion = _tokens(row.status_code, row.body)
            settled.prompt_tokens += prompt
            settled.completion_tokens += completion
        JobLine.objects.bulk_update(rows, ["answered", "status_code", "body"])
        ok = sum(1 for row in rows if row.ok)
        Job.objects.filter(id=job.id).update(
            completed=F("completed") + ok,
            failed=F("failed") + len(rows) - ok,
            prompt_tokens=F("prompt_tokens") + settled.prompt_tokens,
            completion_tokens=F("completion_tokens") + settled.completion_tokens,
        )
    return settled


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
        _settle(job, refusals)
    job.fed_offset, job.fed_lines = offset, index
    job.save(update_fields=["fed_offset", "fed_lines"])
    return pushed


def _unanswered(job: Job, first: int, count: int) -> set[int]:
    lines = JobLine.objects.filter(job=job, line__gte=first, line__lt=first + count,
                                   answered=False).values_list("line", flat=True)  # fmt: skip
    return set(lines)


def serve(stop: threading.Event | None = None) -> None:
    """The feeder process, until SIGTERM or SIGINT (or `stop`): at the lowest CPU priority,
    `tick` every FEED_INTERVAL_S (a failure logged once per outage, as any periodic loop's),
    with the process's models, catalog and keys kept as a web process keeps them, and its
    statistics (the jobs' usage) flushed as a web process flushes them. The lock is let go on
    the way out, so that a feeder started in its place takes over at once."""
    stop = stop or threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    os.nice(NICENESS)  # raising it needs no privilege
    feeder = Feeder(web_process())
    loop = PeriodicLoop("offline-feeder", feeder.tick, FEED_INTERVAL_S, "feed offline jobs")
    log.info("feeding offline jobs every %g s (niceness %d)", FEED_INTERVAL_S, os.nice(0))
    # A failed run keeps the lock: the next renews it with the same token, or finds it lost
    # (LockError) and asks again. Asking with a new token would wait out the held lock's TTL.
    while not stop.wait(FEED_INTERVAL_S):
        loop.run_once()
    feeder.release()
    flush_on_exit()
