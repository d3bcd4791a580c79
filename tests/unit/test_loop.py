"""The periodic loop under the watchers, the web process's flush and the worker's heartbeat: it
outlives whatever its job raises and logs an outage once, not once per run."""

from __future__ import annotations

import logging
import threading

import pytest
import redis
from redis.exceptions import RedisClusterException

from batching.loop import PeriodicLoop
from tests.support.waiting import wait_until


class Flaky:
    """A job that raises the exceptions it is given, one per run, then succeeds."""

    def __init__(self, *failures: Exception) -> None:
        self.failures = list(failures)
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            self.calls += 1
            if self.failures:
                raise self.failures.pop(0)


def test_the_loop_outlives_any_exception_and_logs_the_outage_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # In cluster mode redis-py raises RedisClusterException (not a RedisError) when no node
    # answers; a bug raises anything.
    job = Flaky(
        redis.ConnectionError("refused"),
        RedisClusterException("no node answers"),
        RedisClusterException("no node answers"),
        KeyError("a bug"),
    )
    loop = PeriodicLoop("flaky", job, interval_s=0.01, what="run the flaky job")
    with caplog.at_level(logging.INFO, logger="batching.loop"):
        loop.start()
        try:
            wait_until(lambda: loop.runs >= 2, 5, "two runs after the failures")
        finally:
            loop.stop(timeout_s=1)
    assert job.calls >= 6
    # This loop's lines only: another test's loop, still stopping, may log beside it.
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if "flaky" in r.getMessage()]
    assert lines[0][0] == "WARNING"
    assert lines[0][1].startswith("cannot run the flaky job (ConnectionError: refused)")
    assert lines[1][0] == "INFO"
    assert lines[1][1].startswith("flaky runs again after")
    assert len(lines) == 2


def test_the_interval_is_settable_while_it_runs_and_stop_ends_it() -> None:
    job = Flaky()
    loop = PeriodicLoop("slow", job, interval_s=60.0, first_wait_s=0)
    loop.start()
    wait_until(lambda: job.calls == 1, 2, "the first run at once")
    loop.interval_s = 0.01
    loop.stop(timeout_s=1)  # the 60 s wait ends on stop
    assert not loop.running
    loop.start()  # the new interval from here on
    try:
        wait_until(lambda: job.calls >= 5, 2, "runs at the short interval")
    finally:
        loop.stop(timeout_s=1)
    assert not loop.running


def test_a_jittered_loop_spreads_its_waits_around_its_interval() -> None:
    """Loops of processes started together drift apart (the workers' hand-over scans)."""
    steady = PeriodicLoop("steady", Flaky(), interval_s=0.5)
    assert {steady.next_wait_s() for _ in range(20)} == {0.5}
    spread = PeriodicLoop("spread", Flaky(), interval_s=0.5, jitter=0.2)
    waits = [spread.next_wait_s() for _ in range(200)]
    assert all(0.4 <= wait <= 0.6 for wait in waits)
    assert max(waits) - min(waits) > 0.1  # 200 draws within 1/4 of the range: never seen
