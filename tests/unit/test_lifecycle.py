"""A worker's life (workers.lifecycle.SamplingWorker) on a real Redis, without Celery: its
heartbeat and hand-over loops, its warm stop and its exit path."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from batching.aggregator import HANDOVER_SCAN_MS, BatchAggregator
from tests.support import unique_queue
from tests.support.queue_views import workers_of
from tests.support.waiting import wait_until
from workers.heartbeat import HANDOVER_SCANNERS, handover_scan_interval_s
from workers.lifecycle import EXIT_HUNG_CALL, SamplingWorker
from workers.runner import BatchRunner
from workers.samplers.simulated import SimulatedSampler


class Exits:
    """Stands for os._exit: records the status instead of ending the test process."""

    def __init__(self) -> None:
        self.statuses: list[int] = []

    def __call__(self, status: int) -> None:
        self.statuses.append(status)


@pytest.fixture
def worker(redis_client: redis.Redis) -> Iterator[tuple[SamplingWorker, Exits, list[str]]]:
    aggregator = BatchAggregator(redis_client, unique_queue("life"), deadline_ms=500)
    runner = BatchRunner(aggregator, SimulatedSampler(batch_ms=1), "w")
    resent: list[str] = []
    exits = Exits()
    made = SamplingWorker(runner, resent.append, exit_process=exits)
    made.presence.heartbeat.interval_s = 0.02  # settable: the test need not wait out a second
    yield made, exits, resent
    made.presence.heartbeat.stop()
    made.presence.handover.stop()


def info_of(worker: SamplingWorker) -> dict[str, object]:
    raw = worker.aggregator.client.get(worker.aggregator.keys.worker_info("w"))
    return json.loads(raw) if raw else {}


def test_the_worker_heartbeats_while_it_runs_and_says_goodbye_on_a_warm_stop(
    worker: tuple[SamplingWorker, Exits, list[str]],
) -> None:
    life, exits, _ = worker
    life.start()
    wait_until(lambda: workers_of(life.aggregator).live_count() == 1, 2, "the first heartbeat")
    wait_until(lambda: life.presence.heartbeat.runs >= 3, 2, "heartbeats once an interval")
    assert info_of(life)["state"] == "idle"
    life.stop()
    assert not life.presence.heartbeat.running
    assert not life.presence.handover.running
    assert workers_of(life.aggregator).live_count() == 0
    assert info_of(life)["state"] == "stopped"
    assert exits.statuses == []


def test_a_worker_that_leaves_says_why_and_exits_with_its_status(
    worker: tuple[SamplingWorker, Exits, list[str]],
) -> None:
    life, exits, _ = worker
    life.start()
    wait_until(lambda: workers_of(life.aggregator).live_count() == 1, 2, "the first heartbeat")
    life.leave("hung", EXIT_HUNG_CALL)
    assert exits.statuses == [EXIT_HUNG_CALL]
    assert workers_of(life.aggregator).live_count() == 0
    assert info_of(life)["state"] == "hung"
    life.stop()  # Celery's shutdown signal afterwards: nothing more to do
    assert info_of(life)["state"] == "hung"


def test_a_failing_hand_over_scan_raises_for_its_loop_to_log() -> None:
    nobody = redis.Redis(port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    dead = BatchAggregator(nobody, unique_queue("life"), shards=2)
    life = SamplingWorker(BatchRunner(dead, SimulatedSampler(batch_ms=1), "w"), print)
    with pytest.raises(redis.ConnectionError):
        life.presence.scan_handovers()
    assert not life.presence.handover.run_once()  # the loop logs it, and goes on


def test_the_workers_of_a_queue_share_its_hand_over_scans(
    worker: tuple[SamplingWorker, Exits, list[str]],
) -> None:
    """Together about HANDOVER_SCANNERS scans of a shard each HANDOVER_SCAN_MS, whatever the
    number of workers: each scanning every period cost a farm of 21 on 3 shards 630 scans/s
    for nothing. The heartbeat sets the interval from the live count it reads."""
    life, _, _ = worker
    base_s = HANDOVER_SCAN_MS / 1000
    for live in range(1, 30):
        each_s = handover_scan_interval_s(live)
        assert each_s >= base_s  # no worker scans more often than before
        assert live * base_s / each_s == pytest.approx(min(live, HANDOVER_SCANNERS))
    others = [f"other-{index}" for index in range(2 * HANDOVER_SCANNERS - 1)]
    for name in others:
        workers_of(life.aggregator).heartbeat(name)
    life.presence.beat()
    assert life.runner.live_workers == len(others) + 1
    assert life.presence.handover.interval_s == pytest.approx(2 * base_s)
