"""The per-process runtime of a web process: the catalog of models and, for each model it
serves, an aggregator, live policy, statistics and live workers' count; API keys; over the
process's Redis client (serving.redis_client).

Built lazily after gunicorn forks (and after gevent patches sockets), once per process.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis
from django.conf import settings

from accounts.access import AccessWatcher
from accounts.budgets import Budgets
from accounts.ratelimit import RateLimiter
from batching.aggregator import BatchAggregator
from batching.catalog import POLL_INTERVAL_S, CatalogWatcher, base_catalog
from batching.loop import PeriodicLoop
from batching.policy import Policy, PolicyWatcher, policy_from_settings
from batching.registry import WorkerRegistry
from batching.topology import REDIS_FAULTS
from serving.redis_client import redis_client
from serving.shedding import ADAPT_WINDOW_S, QuickestAnswers, Shedder
from telemetry.stats import RequestStats

log = logging.getLogger(__name__)

BACKGROUND_JOB_INTERVAL_S = 10.0
# A model's "no live worker" older than this is read again before a request is refused.
LIVE_RECHECK_S = 0.05
# An alias's target whose requests failed (5xx of its own) this many times in a row in this
# process gets no new requests from it for COOLDOWN_S when failover is on (serving.routing).
COOLDOWN_AFTER_FAILURES = 3
COOLDOWN_S = 10.0

# A job run every BACKGROUND_JOB_INTERVAL_S in each web process, off the request path:
# job(client, queue, the policy this process applies). The operators' app registers its
# housekeeping here (operations.apps), so the request path does not import that app.
BackgroundJob = Callable[[redis.Redis, str, Policy], None]
_background_jobs: list[BackgroundJob] = []
# Publishes the API keys and tiers again from the database when Redis lost them (the
# operators' app registers it: operations.apps), called by a process's key watcher the moment
# it finds the published set missing, not at the next background job.
AccessRepublisher = Callable[[redis.Redis], object]
_access_republishers: list[AccessRepublisher] = []


_web: dict[int, WebProcess] = {}


def register_background_job(job: BackgroundJob) -> None:
    if job not in _background_jobs:
        _background_jobs.append(job)


@dataclass
class ServedModel:
    """One model as this process serves it: its aggregator, its live policy, its statistics
    buffer and how many live workers it has, the last two kept fresh by one loop (its policy
    and its workers' heartbeats, read twice a second). What a submission uses
    (serving.submission.RequestPath)."""

    name: str
    client: redis.Redis
    aggregator: BatchAggregator
    watcher: PolicyWatcher
    stats: RequestStats
    limiter: RateLimiter
    quickest: QuickestAnswers = field(default_factory=QuickestAnswers)
    live_workers: int | None = None  # None: not read yet (Redis away since it was made)
    # Every live worker reads an item's whole deadline (batching.registry.LiveWorkers).
    read_deadlines: bool = False
    live_read_at: float = 0.0  # monotonic
    failures_in_row: int = 0  # its requests that ended in an error of its own, in a row
    cool_until: float = 0.0  # monotonic: no new requests through an alias before then
    budgets: Budgets | None = None  # its web process's (serving.submission: budget holds)

    def __post_init__(self) -> None:
        self.workers = WorkerRegistry(self.client, self.aggregator.keys)
        self.loop = PeriodicLoop(
            "model-watcher",
            self.refresh,
            POLL_INTERVAL_S,
            f"read the policy and the workers of {self.name}",
        )

    def refresh(self) -> None:
        self.watcher.refresh()
        self.read_live_workers()

    def read_live_workers(self) -> int:
        """How many workers of this model are live now (one round trip), kept."""
        live = self.workers.live()
        self.live_workers, self.read_deadlines = live.live, live.read_deadlines
        self.live_read_at = time.monotonic()
        return self.live_workers

    def has_live_worker(self) -> bool:
        """Whether a worker of this model heartbeated within the heartbeat timeout, by this
        process's last read; a "none" older than LIVE_RECHECK_S is read again first (one
        round trip, on the refusal's path only: a worker that just started is not refused
        for the poll's half second). Unknown (Redis away) counts as live: the join says."""
        if self.live_workers != 0:
            return True
        if time.monotonic() - self.live_read_at > LIVE_RECHECK_S:
            try:
                self.read_live_workers()
            except REDIS_FAULTS:
                return True
        return self.live_workers != 0

    def ended(self, failed: bool) -> None:
        """A request it served ended: a failure of its own (`failed`) or an answer."""
        if not failed:
            self.failures_in_row = 0
            return
        self.failures_in_row += 1
        if self.failures_in_row >= COOLDOWN_AFTER_FAILURES:
            self.failures_in_row = 0
            self.cool_until = time.monotonic() + COOLDOWN_S
            log.warning("model %s failed %d requests in a row: cooling down for %g s",
                        self.name, COOLDOWN_AFTER_FAILURES, COOLDOWN_S)  # fmt: skip

    def usable(self) -> bool:
        """Whether an alias may send it a request now, by this process's memory alone: a
        live worker at the last read, and not cooling down."""
        return self.live_workers != 0 and time.monotonic() >= self.cool_until

    def start(self) -> ServedModel:
        """Read the policy and the workers now (the first request must not see the defaults,
        nor wait for a model with no worker), then poll them."""
        self.loop.run_once()  # a failure is logged, and the loop tries again
        self.loop.start()
        return self


def make_model(client: redis.Redis, name: str, limiter: RateLimiter) -> ServedModel:
    defaults = policy_from_settings(settings)
    aggregator = BatchAggregator(
        client,
        name,
        max_batch_size=defaults.max_batch_size,
        deadline_ms=defaults.deadline_ms,
        shards=settings.SAMPLING_SHARDS,
    )
    watcher = PolicyWatcher(client, name, defaults)
    watcher.on_change(
        lambda p: aggregator.configure(max_batch_size=p.max_batch_size, deadline_ms=p.deadline_ms)
    )
    return ServedModel(name, client, aggregator, watcher, RequestStats(name), limiter)


def listed_models() -> list[tuple[str, str]]:
    """The models the environment lists, (name, sampler), the default model among them."""
    listed = list(settings.SAMPLING_MODELS)
    if all(name != settings.SAMPLING_QUEUE for name, _ in listed):
        listed.insert(0, (settings.SAMPLING_QUEUE, settings.SAMPLER))
    return listed


@dataclass
class WebProcess:
    """What the request path of this process uses: the catalog of models (and one
    ServedModel for each model it served, made on first use, with its own request limits),
    the API keys, the process's rate limiter (tokens per minute, shared by its models'
    limiters) and the shedder, kept up to date by periodic loops (greenlets under gevent): the
    catalog, key and model watchers, the flush of statistics (and the keys' last use), and
    the background jobs. `aggregator`, `watcher` and `stats` are the default model's."""

    client: redis.Redis
    catalog: CatalogWatcher
    access: AccessWatcher
    limiter: RateLimiter
    shedder: Shedder
    default_model: str
    models: dict[str, ServedModel] = field(default_factory=dict)
    budgets: Budgets = field(init=False)

    def __post_init__(self) -> None:
        self.budgets = Budgets(self.client)
        self.flush_loop = PeriodicLoop(
            "stats-flush",
            self._flush,
            settings.SAMPLING_STATS_FLUSH_INTERVAL_S,
            "flush the statistics",
        )
        # Jitter, not a secret: the processes of a node spread their jobs over the interval.
        first_jobs_s = BACKGROUND_JOB_INTERVAL_S * random.random()  # noqa: S311
        self.shed_loop = PeriodicLoop("in-flight-limit", self.shedder.adapt, ADAPT_WINDOW_S)
        self.jobs_loop = PeriodicLoop(
            "background-jobs", self._run_jobs, BACKGROUND_JOB_INTERVAL_S, first_wait_s=first_jobs_s
        )

    def usable(self, name: str) -> bool:
        return self.model(name).usable()

    def model(self, name: str) -> ServedModel:
        """The model `name` as this process serves it, made (and its watcher started) on
        first use."""
        found = self.models.get(name)
        if found is None:
            limiter = RateLimiter(
                self.client,
                count_items=settings.SAMPLING_RATE_LIMIT_PER_ITEM,
                charges=self.limiter.charges,
            )
            # Stored before it reads Redis: a request meanwhile (another greenlet) shares it.
            found = self.models[name] = make_model(self.client, name, limiter)
            found.budgets = self.budgets
            found.start()
        return found

    @property
    def default(self) -> ServedModel:
        return self.model(self.default_model)

    @property
    def aggregator(self) -> BatchAggregator:
        return self.default.aggregator

    @property
    def watcher(self) -> PolicyWatcher:
        return self.default.watcher

    @property
    def stats(self) -> RequestStats:
        return self.default.stats

    def start(self) -> None:
        self.catalog.start()
        self.default.start()
        self.access.after_poll(self._refresh_token_charges)
        self.access.after_poll(self.refresh_budgets)
        self.access.after_poll(self.budgets.release_due)
        self.access.start()
        self.flush_loop.start()
        self.jobs_loop.start()
        self.shed_loop.start()

    def _refresh_token_charges(self) -> None:
        if self.access.limits_tokens:
            self.limiter.refresh_tokens()

    def refresh_budgets(self) -> None:
        """This month's spend of the budgeted keys and owners read again (Redis errors
        raised)."""
        access = self.access
        if access.budgeted or access.owners_keys or self.budgets.spent:
            self.budgets.refresh(
                access.budgeted, self.catalog.current.models, owners_keys=access.owners_keys
            )

    def _flush(self) -> None:
        """Every model's statistics and the keys' last use (all kept for the next try on a
        failure)."""
        settled, flushed = self.budgets.take_settled(), False
        try:
            for served in list(self.models.values()):
                served.stats.flush(self.client)
            flushed = True
        finally:
            self.budgets.flushed(settled, flushed)
            self.access.flush_last_used()

    def _run_jobs(self) -> None:
        for served in list(self.models.values()):
            for job in _background_jobs:
                try:
                    job(self.client, served.name, served.watcher.current)
                except Exception:  # a failing job must not keep the others from running
                    log.exception("background job %s failed", job.__qualname__)


def register_access_republisher(republish: AccessRepublisher) -> None:
    if republish not in _access_republishers:
        _access_republishers.append(republish)


def _republish_access(client: redis.Redis) -> None:
    for republish in _access_republishers:
        republish(client)


def web_process() -> WebProcess:
    pid = os.getpid()
    found = _web.get(pid)
    if found is None:
        client = redis_client()
        found = _web[pid] = WebProcess(
            client,
            CatalogWatcher(client, base_catalog(listed_models())),
            AccessWatcher(client, republish=lambda: _republish_access(client)),
            RateLimiter(client, count_items=settings.SAMPLING_RATE_LIMIT_PER_ITEM),
            Shedder(settings.WEB_MAX_IN_FLIGHT),
            settings.SAMPLING_QUEUE,
        )
        found.start()
    return found


def flush_on_exit() -> None:
    """This process's last statistics, as it leaves (gunicorn's worker_exit, after its
    requests ended): counted once even if an earlier flush is sent again with them."""
    found = _web.get(os.getpid())
    if found is None:
        return
    for served in found.models.values():
        try:
            served.stats.flush(found.client)
        except Exception as exc:  # noqa: BLE001 - Redis away: what is left is lost, and said
            log.error("statistics of %s not flushed at exit (%d flushes lost): %s",
                      served.name, served.stats.flusher.unsent, exc)  # fmt: skip


def warm_up() -> None:
    """Pay at process start what the first requests would otherwise pay inside their deadline
    (measured: the first /sample of a fresh process took ~30 ms longer than the next): the
    view's imports, a Redis connection with the Lua scripts loaded, the broker connection of
    Celery's producer, and the result listener's subscription connection, for every model the
    environment lists. Called by
    gunicorn's post_worker_init; a failure is only logged, the requests will retry."""
    from django.urls import resolve
    from kombu.common import maybe_declare

    from batching.results import SharedListenerRedisBackend
    from serving.broker import app as celery_app

    resolve("/sample")  # imports the view and the result backend
    try:
        process = web_process()
        served = [process.model(name) for name, _ in listed_models()]
        for model in served:
            model.aggregator.load_scripts()
        with celery_app.producer_pool.acquire(block=True, timeout=2) as producer:
            assert producer.connection is not None  # a pooled producer has one
            producer.connection.ensure_connection(max_retries=1)
            # The first publish to a queue declares it on that connection: do it now.
            for model in served:
                queue = celery_app.amqp.queues[model.name]
                maybe_declare(queue, producer.channel)  # type: ignore[arg-type]  # a channel
        backend = celery_app.backend
        if isinstance(backend, SharedListenerRedisBackend):  # as CELERY_RESULT_BACKEND says
            backend.listener.subscribe(
                [keys.results for model in served for keys in model.aggregator.shards]
            )
    except Exception as exc:  # noqa: BLE001 - Redis or the broker down at start: requests say so
        log.warning("web process warm-up incomplete: %s", exc)
