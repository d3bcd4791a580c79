"""Offline jobs moved on, off the request path: the feeder process (`python manage.py
runfeeder`: `serve`), one of the deployment's at a time (a Redis lock, renewed on each run,
taken with a generation that fences the answers it trims), runs `tick` every FEED_INTERVAL_S:

1. validating jobs: the input file read through (offline.validate); in_progress, or failed;
2. answers collected from the backfill lanes of every model with a job (offline.feeding):
   each line keeps its first answer (JobLine), its job's counts and spend follow, and the
   job's charge goes to its key's statistics once (offline.charges);
3. items taken longer than SAMPLING_BACKFILL_TAKEN_TIMEOUT_S ago put back (their worker
   died); after Redis lost the lanes (a restart: a shard's epoch key is gone), each job's
   unanswered lines fed again; fed lines found in no lane for RECONCILE_AFTER_S (a restart
   that kept Redis's data less its last writes) fed again;
4. in_progress jobs fed until each model's lanes hold AHEAD_CALLS calls' worth per live
   worker (an idle farm never waits for the next run), the room dealt evenly to the keys with
   a job, each key's jobs oldest first, a key with a budget only what it may pay for; a job
   whose key was revoked or spent its budget stopped (offline.standing);
5. jobs with every line answered finalized (offline.finish); a cancelled or expired job's
   items withdrawn, and once none is still in a call, finalized with what is done; a job
   left finalizing (its run cut short) finalized again.

A job's step that fails is logged and counted (offline.failures), and the run goes on with
the other jobs.

The process that holds the lock feeds every model (docs/guides/batch.md). It runs at the
lowest CPU priority (NICENESS): its work (files, the database, JSON) must never take a core
from the requests it may share a machine with (docs/benchmarks/backfill.md).
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
from typing import Any

import redis
from django.conf import settings
from django.db import close_old_connections
from django.utils import timezone
from redis.exceptions import LockError

from batching import scripts
from batching.backfill import Backfill, StaleFeeder
from batching.catalog import Price
from batching.keys import QueueKeys
from batching.loop import PeriodicLoop
from offline import charges, finish, uploads, validate
from offline.failures import count_failure
from offline.feeding import collect, feed
from offline.lines import kind_of
from offline.models import Job, JobLine, Status
from offline.standing import affordable, fail_unanswered, refusal_of
from serving.routing import key_sticky
from serving.runtime import ServedModel, WebProcess, flush_on_exit, web_process

log = logging.getLogger(__name__)

FEED_INTERVAL_S = 0.25
# Items kept waiting per live worker of a model: this many of its calls' worth (2 s of an
# idle GPU: a worker that finds the lane empty takes none until its next heartbeat, so a
# feeder's slow run must not empty it).
AHEAD_CALLS = 20
# How often the lanes are scanned for jobs whose fed lines are nowhere (batching.backfill:
# jobs_held), and how long a job's fed, unanswered lines must have been nowhere before they
# are fed again: Redis kept its data but lost its last writes (an AOF cut).
RECONCILE_EVERY_S = 5.0
RECONCILE_AFTER_S = 10.0
# The feeder process's niceness: the lowest CPU priority.
NICENESS = 19


class Feeder:
    def __init__(self, process: WebProcess) -> None:
        self.process = process
        self.client = process.client
        keys = QueueKeys(process.default_model)
        # The lock outlives a run by far (a file of 50,000 lines validates in a few seconds).
        self.lock = self.client.lock(
            keys.feeder_lock, timeout=settings.SAMPLING_FEEDER_LOCK_TTL_S, blocking=False
        )
        self._take = scripts.register(self.client, "take_feeder_lock")
        self._lock_keys = [keys.feeder_lock, keys.feeder_generation]
        self.held = False
        self.generation = 0  # this holding's, above every earlier one's: Backfill's fences
        self._reconciled: dict[str, float] = {}  # model -> when its lanes were last scanned
        self._missing_since: dict[str, float] = {}  # job -> since when its fed lines are nowhere
        self._swept = 0.0  # when every job's pending charge was last sent (monotonic)
        self._withdrawn_at: dict[str, float] = {}  # job -> when its waiting items were withdrawn

    def tick(self) -> None:
        if not self._hold():
            return
        try:
            self._run()
        except StaleFeeder as stale:  # stalled past the lock: the successor feeds now
            log.warning("this feeder stalled past its lock and stops: %s", stale)
            self.held = False
        finally:
            close_old_connections()

    def _run(self) -> None:
        if time.monotonic() - self._swept >= RECONCILE_EVERY_S:
            self._swept = time.monotonic()
            self._charge_left()
            uploads.sweep_abandoned()
        moving = [Status.VALIDATING, Status.IN_PROGRESS, Status.CANCELLING, Status.FINALIZING]
        jobs = list(Job.objects.filter(status__in=moving).order_by("created"))
        for job in jobs:
            if job.status == Status.VALIDATING:
                _alone(job.id, "validated", validate.checked, self.process, job)
            elif job.status == Status.FINALIZING:  # the last attempt was cut short
                _alone(job.id, "finalized", self._finalize, job, finish.ending_of(job))
        by_model: dict[str, list[Job]] = defaultdict(list)
        for job in jobs:
            if job.status == Status.CANCELLING and not job.model:  # before it had lines
                _alone(job.id, "finalized", self._finalize, job, Status.CANCELLED)
            elif job.status in (Status.IN_PROGRESS, Status.CANCELLING) and job.model:
                by_model[job.model].append(job)
        for model, model_jobs in by_model.items():
            self._move_on(self.process.model(model), model_jobs)

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
            else:  # the lock and a new generation in one step
                token = secrets.token_hex(8).encode()
                ttl_ms = int(settings.SAMPLING_FEEDER_LOCK_TTL_S * 1000)
                generation = int(self._take(keys=self._lock_keys, args=[token, ttl_ms]))
                if generation:
                    self.lock.local.token = token  # renewed and released as the lock's own
                    self.generation, self.held = generation, True
        except LockError:  # lost it (it expired: this process stalled): another may feed
            self.held = False
        return self.held

    def _move_on(self, model: ServedModel, jobs: list[Job]) -> None:
        lanes = Backfill(self.client, model.aggregator.shards, self.generation)
        epoch = self._epoch(model)
        for job in jobs:  # a charge cut short before its settles more: offline.charges
            self._charge(job)
        collect(lanes, {job.id: job for job in jobs}, self._price, self._charge, self._count)
        self.process.refresh_budgets()  # a budget just crossed stops the job's feeding now
        self._reconcile(lanes, model, jobs)
        timeout_ms = round(settings.SAMPLING_BACKFILL_TAKEN_TIMEOUT_S * 1000)
        lanes.requeue_stale(int(time.time() * 1000), timeout_ms)
        waiting, _ = lanes.depth()
        live = model.workers.live_count()
        room = max(0, AHEAD_CALLS * model.watcher.current.max_batch_size * max(1, live) - waiting)
        # The room dealt evenly to the keys with a job to feed, each key's jobs oldest first:
        # one tenant's long job cannot hold another's back until it is all fed.
        by_key: dict[int, list[str]] = defaultdict(list)
        for job in jobs:
            if job.status == Status.IN_PROGRESS:
                by_key[job.key_id].append(job.id)
        share = dict.fromkeys(by_key, max(1, room // max(1, len(by_key))))
        first_call = model.watcher.current.max_batch_size
        for key_id, job_ids in by_key.items():  # a key with a budget: what it may pay for
            budget = affordable(self.process, key_id, job_ids, first_call, self._price)
            if budget is not None:
                share[key_id] = min(share[key_id], budget)
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
        elif job.status == Status.IN_PROGRESS and (failure := refusal_of(self.process, job.key_id)):
            if not self._withdrawn(lanes, job):  # its calls running finish, and are charged
                log.warning("job %s stopped: %s", job.id, failure.message)
                fail_unanswered(job, failure)
                self._finalize(job, Status.COMPLETED)
        elif job.status == Status.IN_PROGRESS and (target := self._split_target(job)):
            self._move_to(lanes, job, target)
        elif job.status == Status.IN_PROGRESS:
            if job.epoch != epoch:  # the lanes were lost since it was fed: again
                job.fed_lines, job.fed_offset, job.epoch = 0, 0, epoch
                job.save(update_fields=["fed_lines", "fed_offset", "epoch"])
            if room > 0:
                fed = feed(lanes, model, job, room)
            if job.completed + job.failed >= job.total:
                self._finalize(job, Status.COMPLETED)
        return fed

    def _split_target(self, job: Job) -> str:
        """The model a job through an alias runs on from now, where it is not the one it runs
        on: the key's target in the alias's current split (a canary rolled back, weights
        changed); "" to stay."""
        catalog = self.process.catalog.current
        alias = catalog.aliases.get(job.alias) if job.alias else None
        target = alias.pick(key_sticky(job.key_id)) if alias is not None else None
        entry = catalog.models.get(target) if target is not None else None
        if entry is None or entry.name == job.model or entry.kind != kind_of(job.endpoint):
            return ""
        return entry.name

    def _move_to(self, lanes: Backfill, job: Job, target: str) -> None:
        """A job's waiting lines withdrawn from its model's lanes; once none is in a call or
        answered and not collected, and its charge is sent, it runs on `target`, fed again
        from its first unanswered line."""
        # Withdrawn at every pass: a stale item put back, or a call's give-back, since.
        removed, _ = lanes.withdraw(job.id)
        if removed or lanes.in_calls(job.id) or lanes.withdraw(job.id)[0]:
            return
        self._charge(job)
        if Job.objects.filter(charges.PENDING, id=job.id).exists():
            return  # its charge goes to the model that answered: first sent, next pass
        Job.objects.filter(id=job.id, model=job.model).update(
            model=target, fed_lines=0, fed_offset=0, epoch=""
        )
        log.info("job %s moves from %s to %s: alias %s", job.id, job.model, target, job.alias)

    def _withdrawn(self, lanes: Backfill, job: Job) -> int:
        """A job that feeds no more: its waiting items out of the lanes (one scan of each,
        again every RECONCILE_EVERY_S, for items put back since), and how many are still in
        calls or answered and not collected (0: its lines may be finalized)."""
        now = time.monotonic()
        if now - self._withdrawn_at.get(job.id, 0.0) >= RECONCILE_EVERY_S:
            self._withdrawn_at[job.id] = now
            lanes.withdraw(job.id)
        left = lanes.in_calls(job.id)
        if not left:
            self._withdrawn_at.pop(job.id, None)
        return left

    def _reconcile(self, lanes: Backfill, model: ServedModel, jobs: list[Job]) -> None:
        """Fed lines that no lane, taken set nor done list holds any more, and that are not
        answered, fed again once they have been nowhere for RECONCILE_AFTER_S: a job is
        rewound to its first line (its answered lines are skipped as it is fed again)."""
        now = time.monotonic()
        if now - self._reconciled.get(model.name, 0.0) < RECONCILE_EVERY_S:
            return
        self._reconciled[model.name] = now
        held = lanes.jobs_held()
        for job in jobs:
            fed = JobLine.objects.filter(job=job, answered=False, line__lt=job.fed_lines)
            if job.id in held or job.status != Status.IN_PROGRESS or not fed.exists():
                self._missing_since.pop(job.id, None)
                continue
            since = self._missing_since.setdefault(job.id, now)
            if now - since >= RECONCILE_AFTER_S:
                log.warning("job %s: fed lines lost from Redis; feeding them again", job.id)
                Job.objects.filter(id=job.id).update(fed_lines=0, fed_offset=0)
                del self._missing_since[job.id]

    def _count(self, job: Job, settled: charges.Settled) -> None:
        """A job's lines answered on its model, in the model's statistics as their own
        class (beside its requests: a canary's trial shows them apart)."""
        self.process.model(job.model).stats.record_offline(settled.ok, settled.errors)

    def _charge(self, job: Job) -> None:
        if job.model:
            charges.send_charge(self.client, job.id, job.model)

    def _finalize(self, job: Job, status: Status) -> None:
        """A job's pending charge sent, then the job finalized (offline.finish)."""
        self._charge(job)
        finish.finalize(job, status)

    def _charge_left(self) -> None:
        """Every job's charge still pending sent, whatever its status: one written by a
        feeder that was fenced off before it could send it."""
        for job in Job.objects.filter(charges.PENDING).exclude(model=""):
            _alone(job.id, "charged", self._charge, job)

    def _price(self, job: Job) -> Price:
        """A job's price: its own (kept when it was validated), else its model's batch price
        in the catalog now (ModelEntry.batch_price)."""
        entry = self.process.catalog.current.models.get(job.model)
        return charges.price_of(job, entry.batch_price if entry is not None else None)

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
        if not self._withdrawn(lanes, job):
            self._finalize(job, finish.ending_of(job))


def _alone(job_id: str, what: str, step: Callable[..., Any], *args: Any) -> Any:
    """`step(*args)` for one job: its failure logged and counted (QueueKeys.feeder_failures,
    on /metrics), each time, and the run goes on with the other jobs (0 for it). Redis away
    fails the whole run: every job needs it."""
    try:
        return step(*args)
    except redis.RedisError:
        raise
    except Exception:
        log.exception("job %s could not be %s; the next run tries again", job_id, what)
        count_failure(what)
        return 0


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
