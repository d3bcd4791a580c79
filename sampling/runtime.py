"""The per-process runtime of a web process: aggregator, live policy, API keys, statistics,
over the process's Redis client (inference_site.redis_client).

Built lazily after gunicorn forks (and after gevent patches sockets), once per process.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable
from dataclasses import dataclass

import redis
from django.conf import settings

from batching.access import AccessWatcher
from batching.aggregator import BatchAggregator
from batching.loop import PeriodicLoop
from batching.policy import Policy, PolicyWatcher, policy_from_settings
from batching.ratelimit import RateLimiter
from batching.stats import RequestStats
from inference_site.redis_client import redis_client
from sampling.shedding import Shedder

log = logging.getLogger(__name__)

BACKGROUND_JOB_INTERVAL_S = 10.0

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
class WebProcess:
    """What the request path of this process uses: the aggregator, the live policy, the API
    keys and the statistics buffer, kept up to date by four periodic loops (greenlets under
    gevent): the policy and key watchers, the flush of statistics (and the keys' last use),
    and the background jobs."""

    client: redis.Redis
    aggregator: BatchAggregator
    watcher: PolicyWatcher
    stats: RequestStats
    access: AccessWatcher
    limiter: RateLimiter
    shedder: Shedder

    def __post_init__(self) -> None:
        self.flush_loop = PeriodicLoop(
            "stats-flush",
            self._flush,
            settings.SAMPLING_STATS_FLUSH_INTERVAL_S,
            "flush the statistics",
        )
        # Jitter, not a secret: the processes of a node spread their jobs over the interval.
        first_jobs_s = BACKGROUND_JOB_INTERVAL_S * random.random()  # noqa: S311
        self.jobs_loop = PeriodicLoop(
            "background-jobs", self._run_jobs, BACKGROUND_JOB_INTERVAL_S, first_wait_s=first_jobs_s
        )

    def start(self) -> None:
        self.watcher.start()
        self.access.after_poll(self._refresh_token_charges)
        self.access.start()
        self.flush_loop.start()
        self.jobs_loop.start()

    def _refresh_token_charges(self) -> None:
        if self.access.limits_tokens:
            self.limiter.refresh_tokens()

    def _flush(self) -> None:
        """The statistics and the keys' last use (both kept for the next try on a failure)."""
        try:
            self.stats.flush(self.client)
        finally:
            self.access.flush_last_used()

    def _run_jobs(self) -> None:
        for job in _background_jobs:
            try:
                job(self.client, self.aggregator.queue, self.watcher.current)
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
        defaults = policy_from_settings(settings)
        aggregator = BatchAggregator(
            client,
            settings.SAMPLING_QUEUE,
            max_batch_size=defaults.max_batch_size,
            deadline_ms=defaults.deadline_ms,
            shards=settings.SAMPLING_SHARDS,
        )
        watcher = PolicyWatcher(client, settings.SAMPLING_QUEUE, defaults)
        watcher.on_change(
            lambda p: aggregator.configure(
                max_batch_size=p.max_batch_size, deadline_ms=p.deadline_ms
            )
        )
        found = _web[pid] = WebProcess(
            client,
            aggregator,
            watcher,
            RequestStats(aggregator.queue),
            AccessWatcher(client, republish=lambda: _republish_access(client)),
            RateLimiter(client, count_items=settings.SAMPLING_RATE_LIMIT_PER_ITEM),
            Shedder(settings.WEB_MAX_IN_FLIGHT),
        )
        found.start()
    return found


def flush_on_exit() -> None:
    """This process's last statistics, as it leaves (gunicorn's worker_exit, after its
    requests ended): counted once even if an earlier flush is sent again with them."""
    found = _web.get(os.getpid())
    if found is None:
        return
    try:
        found.stats.flush(found.client)
    except Exception as exc:  # noqa: BLE001 - Redis away: what is left is lost, and said
        log.error("statistics not flushed at exit (%d flushes lost): %s",
                  found.stats.flusher.unsent, exc)  # fmt: skip


def warm_up() -> None:
    """Pay at process start what the first requests would otherwise pay inside their deadline
    (measured: the first /sample of a fresh process took ~30 ms longer than the next): the
    view's imports, a Redis connection with the Lua scripts loaded, the broker connection of
    Celery's producer, and the result listener's subscription connection. Called by
    gunicorn's post_worker_init; a failure is only logged, the requests will retry."""
    from django.urls import resolve
    from kombu.common import maybe_declare

    from batching.results import SharedListenerRedisBackend
    from inference_site.celery import app as celery_app

    resolve("/sample")  # imports the view and the result backend
    try:
        web_process().aggregator.load_scripts()
        with celery_app.producer_pool.acquire(block=True, timeout=2) as producer:
            assert producer.connection is not None  # a pooled producer has one
            producer.connection.ensure_connection(max_retries=1)
            # The first publish to a queue declares it on that connection: do it now.
            queue = celery_app.amqp.queues[settings.SAMPLING_QUEUE]
            maybe_declare(queue, producer.channel)  # type: ignore[arg-type]  # a channel here
        backend = celery_app.backend
        if isinstance(backend, SharedListenerRedisBackend):  # as CELERY_RESULT_BACKEND says
            backend.listener.subscribe([keys.results for keys in web_process().aggregator.shards])
    except Exception as exc:  # noqa: BLE001 - Redis or the broker down at start: requests say so
        log.warning("web process warm-up incomplete: %s", exc)
