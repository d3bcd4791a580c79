"""A job run every few seconds in a daemon thread (a greenlet under gevent), for the life of
the process: the key and policy watchers, a web process's statistics flush and background
jobs, a worker's heartbeat and hand-over scan.

The loop outlives any exception its job raises: Redis away raises `redis.RedisError`, but a
cluster with no node answering raises `RedisClusterException`, which is not one, and a loop
that let it through would have stopped for the life of the process. An outage is logged
twice: one warning when the job starts failing, one info line when it runs again, not one
line per failed run.

Knows nothing of Django nor of what its job does.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

import redis
from redis.exceptions import RedisClusterException

log = logging.getLogger(__name__)

# Failures expected of a job talking to a server (its message says enough); any other
# exception is logged with its traceback, once per outage too.
EXPECTED_FAILURES: tuple[type[Exception], ...] = (
    redis.RedisError,
    RedisClusterException,
    OSError,
)


class PeriodicLoop:
    """Runs `job()` every `interval_s` seconds (settable while it runs: the next wait uses
    the new value) from `start()` until `stop()`. `what` names the job in the log lines
    ("cannot <what>"). The first run comes after `first_wait_s` (default: one interval;
    0: at once). `jitter`: each wait is the interval times a random factor within 1 +/- it,
    so that the loops of processes started together do not run in step."""

    def __init__(
        self,
        name: str,
        job: Callable[[], object],
        interval_s: float,
        what: str = "",
        first_wait_s: float | None = None,
        jitter: float = 0.0,
    ) -> None:
        self.name = name
        self.job = job
        self.interval_s = interval_s
        self.jitter = jitter
        self.what = what or f"run {name}"
        self.first_wait_s = first_wait_s
        self.runs = 0  # successful runs, for tests and operators
        self.failing_since: float | None = None  # monotonic, while the job fails
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def start(self) -> PeriodicLoop:
        """Starts the thread, unless it runs already."""
        if not self.running:
            self._stop = threading.Event()  # a thread still leaving keeps its own, set
            self._thread = threading.Thread(
                target=self._run, args=(self._stop,), name=self.name, daemon=True
            )
            self._thread.start()
        return self

    def stop(self, timeout_s: float | None = None) -> None:
        """No run starts after this; with `timeout_s`, waits that long for a running one."""
        self._stop.set()
        if timeout_s is not None and self._thread is not None:
            self._thread.join(timeout_s)

    def run_once(self) -> bool:
        """One run of the job, its failure logged (once per outage) and swallowed; True when
        it succeeded."""
        try:
            self.job()
        except Exception as exc:  # whatever a client library raises: the next run retries
            if self.failing_since is None:
                self.failing_since = time.monotonic()
                log.warning(
                    "cannot %s (%s: %s); retrying every %g s",
                    self.what,
                    type(exc).__name__,
                    exc,
                    self.interval_s,
                    exc_info=not isinstance(exc, EXPECTED_FAILURES),
                )
            return False
        if self.failing_since is not None:
            log.info(
                "%s runs again after %.1f s of failures",
                self.name,
                time.monotonic() - self.failing_since,
            )
            self.failing_since = None
        self.runs += 1
        return True

    def _run(self, stop: threading.Event) -> None:
        wait_s = self.interval_s if self.first_wait_s is None else self.first_wait_s
        while not stop.wait(wait_s):
            self.run_once()
            wait_s = self.next_wait_s()

    def next_wait_s(self) -> float:
        """The wait before the next run: the interval, spread by the jitter."""
        spread = random.uniform(1 - self.jitter, 1 + self.jitter)  # noqa: S311 - not a secret
        return self.interval_s * spread
