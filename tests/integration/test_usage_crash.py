"""A Redis crash (SIGKILL) while a web process's statistics flushes stream in: with the
append-only file fsynced every second (deploy/redis.conf), what Redis had acknowledged and
lost is within about a second of flushes (two at worst, Redis's own bound for `everysec`);
without it, everything not yet persisted to the database is lost."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from batching.outcomes import RequestOutcome
from devstack.embedded_redis import EmbeddedRedis
from telemetry import stats
from tests.support import unique_queue
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

FLUSH_EVERY_S = 0.01  # a flush every 10 ms: 100 a second, far more often than a web process's
RUN_S = 3.0
# The documented bound with AOF everysec: two seconds of acknowledged writes.
AOF_LOSS_BOUND_S = 2.0


def stream_then_crash(server: EmbeddedRedis, queue: str) -> tuple[int, float, int]:
    """Flushes of one request each for RUN_S, then SIGKILL and a restart: (flushes Redis
    acknowledged, their rate per second, requests Redis holds after the restart)."""
    client = redis.Redis.from_url(server.url)
    recorder = stats.RequestStats(queue)
    second = int(time.time())  # every count in one bucket, read back whole
    acked = 0
    began = time.monotonic()
    while time.monotonic() - began < RUN_S:
        recorder.record(RequestOutcome.OK, 0.001, now=second)
        acked += recorder.flush(client)
        time.sleep(FLUSH_EVERY_S)  # duration: the flushes' pace
    rate = acked / (time.monotonic() - began)
    server.kill()
    server.start()
    client = redis.Redis.from_url(server.url)

    def loaded() -> bool:
        try:
            return bool(client.ping())
        except redis.BusyLoadingError:
            return False

    wait_until(loaded, 10)
    [(_, counts)] = stats.read_buckets(client, queue, stats.SECOND, second, second + 1)
    return acked, rate, counts["req:ok"]


def test_a_crash_with_aof_everysec_loses_at_most_about_a_second(tmp_path: Path) -> None:
    server = EmbeddedRedis(
        dir=tmp_path, extra_args=["--appendonly", "yes", "--appendfsync", "everysec"]
    ).start()
    try:
        acked, rate, kept = stream_then_crash(server, unique_queue("crash"))
    finally:
        server.stop()
    assert kept <= acked
    assert acked - kept <= AOF_LOSS_BOUND_S * rate, (acked, kept, rate)


def test_a_crash_without_aof_loses_every_count_not_yet_persisted(tmp_path: Path) -> None:
    server = EmbeddedRedis(dir=tmp_path).start()  # --appendonly no, no snapshots
    try:
        acked, _, kept = stream_then_crash(server, unique_queue("crash"))
    finally:
        server.stop()
    assert acked > 0
    assert kept == 0
