"""A live worker's presence in Redis: its name's claim, its heartbeat (liveness, its row of
the stats page, its statistics and admission figures), its scan for batches due for a
hand-over, and its goodbye. workers.lifecycle starts and stops them."""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import sys
import time
from collections.abc import Callable
from typing import cast

import redis

from batching import topology
from batching.admission import AdmissionInputs
from batching.aggregator import HANDOVER_SCAN_MS, BatchAggregator
from batching.loop import PeriodicLoop
from batching.registry import HEARTBEAT_TIMEOUT_MS, WorkerRegistry
from batching.topology import REDIS_FAULTS
from telemetry import stats
from workers.runner import BatchRunner

log = logging.getLogger(__name__)

# The exit status of a worker started under a name another live worker process runs as
# (sysexits' EX_CONFIG): two workers of one name would count as one live worker.
EXIT_DUPLICATE_NAME = 78
HEARTBEAT_INTERVAL_S = 1.0
# A stopped worker's row stays on the stats page this long.
WORKER_INFO_TTL_MS = stats.KNOWN_WORKERS_S * 1000
# How long a worker waits for its name at start: a predecessor killed without its goodbye
# (SIGKILL, a crash) holds it until its claim expires, HEARTBEAT_TIMEOUT_MS after its last
# renewal; a live one renews it every HEARTBEAT_INTERVAL_S and keeps it.
NAME_CLAIM_WAIT_S = HEARTBEAT_TIMEOUT_MS / 1000 + 1
# About this many of a queue's workers scan a shard each HANDOVER_SCAN_MS, however many there
# are: a worker scans every HANDOVER_SCAN_MS x live workers / HANDOVER_SCANNERS. Every worker
# scanning every 100 ms cost 21 simulated workers on 3 shards 0.3 of a core at idle (630
# scans/s) on the 2-core bench, where a few scans in a period take a hand-over as soon.
HANDOVER_SCANNERS = 3
# Each scan's wait is its interval within +/- this share, so that workers started together
# do not scan in step (and leave the rest of the interval unscanned).
HANDOVER_SCAN_JITTER = 0.2


def handover_scan_interval_s(live_workers: int) -> float:
    """How often each of `live_workers` workers scans for hand-overs: together, about
    HANDOVER_SCANNERS scans of each shard every HANDOVER_SCAN_MS."""
    return HANDOVER_SCAN_MS / 1000 * max(1.0, live_workers / HANDOVER_SCANNERS)


class DuplicateName(Exception):
    """Another live process runs as this worker's name."""


class NameClaim:
    """This process's claim on its worker name, held from before its sampler loads until it
    stops: one live process a name in the heartbeats (batching.registry). A second process
    started under a live worker's name refuses to start; one that finds its claim taken
    later (Redis lost it for longer than the claim lasts, and another process took it)
    exits at once, without the goodbye that would remove the other's heartbeat."""

    def __init__(self, aggregator: BatchAggregator, worker: str) -> None:
        self.registry = WorkerRegistry(aggregator.client, aggregator.keys)
        self.worker = worker
        self.token = f"{socket.gethostname()} pid {os.getpid()} {secrets.token_hex(4)}"
        self.loop = PeriodicLoop(
            "name-claim", self.renew, HEARTBEAT_INTERVAL_S, f"renew the claim on {worker}"
        )

    def acquire(self, wait_s: float = NAME_CLAIM_WAIT_S) -> NameClaim:
        """Claim the name, waiting up to `wait_s` for a dead predecessor's claim to expire;
        raises DuplicateName when a live process holds it all along."""
        deadline = time.monotonic() + wait_s
        while (owner := self._try_claim()) is not None:
            if time.monotonic() >= deadline:
                raise DuplicateName(
                    f"worker {self.worker}: another live worker process runs under this name "
                    f"({owner}); give each worker a name of its own (celery worker --hostname)"
                )
            time.sleep(0.2)  # duration: the poll of a claim that expires by itself
        self.loop.start()
        return self

    def _try_claim(self) -> str | None:
        try:
            return self.registry.claim(self.worker, self.token)
        except topology.REDIS_FAULTS as exc:  # Redis away at start: the renewals claim it
            log.warning("worker %s: its name cannot be claimed yet: %s", self.worker, exc)
            return None

    def renew(self) -> None:
        owner = self.registry.claim(self.worker, self.token)
        if owner is not None:
            log.critical(
                "worker %s: its name was claimed by another live process (%s): exiting with "
                "status %d, without a goodbye (the name's heartbeat is the other's now)",
                self.worker,
                owner,
                EXIT_DUPLICATE_NAME,
            )
            flush_logs()
            os._exit(EXIT_DUPLICATE_NAME)

    def release(self) -> None:
        self.loop.stop(timeout_s=0.5)
        try:
            self.registry.release(self.worker, self.token)
        except topology.REDIS_FAULTS as exc:  # it expires by itself
            log.warning("worker %s: its name's claim not released: %s", self.worker, exc)


class Presence:
    """A worker's two loops: its heartbeat every HEARTBEAT_INTERVAL_S, and its scan for
    hand-overs, whose interval follows the live workers' count. `resend` sends a batch's
    task again."""

    def __init__(self, runner: BatchRunner, resend: Callable[[str], None]) -> None:
        self.runner = runner
        self.resend = resend
        self.heartbeat = PeriodicLoop(
            "heartbeat", self.beat, HEARTBEAT_INTERVAL_S, "send the heartbeat", first_wait_s=0
        )
        self.handover = PeriodicLoop(
            "handover",
            self.scan_handovers,
            handover_scan_interval_s(runner.live_workers),
            "scan for hand-overs",
            jitter=HANDOVER_SCAN_JITTER,
        )

    def start(self) -> None:
        self.heartbeat.start()
        self.handover.start()

    def stop(self) -> None:
        # A heartbeat in flight finishes first: it would count the worker again after its
        # goodbye.
        self.heartbeat.stop(timeout_s=0.5)
        self.handover.stop()

    def scan_handovers(self) -> None:
        """Send again the task of any batch due for a hand-over (a dispatcher or a worker
        died before the send or the seal) on a shard this worker has not sealed lately: a
        seal takes a shard's hand-overs itself, so under load this costs nothing. Every shard
        is scanned; the first failure is raised after."""
        scan_s = HANDOVER_SCAN_MS / 1000
        failure: Exception | None = None
        now = time.monotonic()
        for index, keys in enumerate(self.runner.aggregator.shards):
            # Sealed lately (by this worker; the others' seals take hand-overs too): a shard
            # with traffic needs no scan. Three periods, as a worker's own seals come about
            # one call apart.
            if now - self.runner.sealed_at.get(keys.tag, float("-inf")) < 3 * scan_s:
                continue
            try:
                for batch_id in self.runner.aggregator.take_due_handovers(index):
                    log.warning(
                        "batch %s was due for a hand-over: sending its task again", batch_id
                    )
                    self.resend(batch_id)
            except Exception as exc:  # noqa: BLE001 - Redis or the broker away: next shard
                failure = failure or exc
        if failure is not None:
            raise failure

    def beat(self) -> None:
        """Liveness (for admission and /readyz), the worker's row of the stats page, its
        alive-seconds (for busy %), its Prometheus metrics, and every shard's admission
        figures: two round trips, and one per shard (and one more on a cluster)."""
        runner, aggregator = self.runner, self.runner.aggregator
        now = time.time()
        runner.live_workers = max(1, runner.workers.heartbeat(runner.worker))
        self.handover.interval_s = handover_scan_interval_s(runner.live_workers)
        info = worker_info(runner, now)
        # The policy version on every shard before the info reports it: the response cache
        # serves no answer of an older one once every worker reports a newer.
        version = cast(int, info["policy_version"])
        cluster = topology.is_cluster(aggregator.client)
        if cluster:  # other masters: one away must not keep the heartbeat from the others
            try:
                with aggregator.client.pipeline(transaction=False) as pipe:
                    aggregator.queue_cache_version(pipe, version)
                    pipe.execute()
            except REDIS_FAULTS as exc:
                log.warning("policy version %d not written on every shard: %s", version, exc)
        with aggregator.client.pipeline(transaction=False) as pipe:
            if not cluster:
                aggregator.queue_cache_version(pipe, version)
            pipe.set(
                aggregator.keys.worker_info(runner.worker), json.dumps(info), px=WORKER_INFO_TTL_MS
            )
            counts = runner.take_queue_times(now)
            counts.update(stats.alive_counts(runner.worker))
            stats.add_counts(pipe, aggregator.queue, now, counts)
            runner.metrics.publish(pipe, aggregator.queue, now)
            runner.batch_log.queue_turn_ms(pipe, runner.turn_ms, aggregator.ttl_ms)
            for keys in aggregator.shards:  # offline jobs' items waiting (batching.backfill)
                pipe.llen(keys.backfill)
            replies = pipe.execute()
        waiting = replies[len(replies) - len(aggregator.shards) :]
        for keys, left in zip(aggregator.shards, waiting, strict=True):
            runner.backfill_left[keys.tag] = int(left)
        aggregator.refresh_admission(AdmissionInputs(runner.live_workers, runner.turn_ms))


def worker_info(runner: BatchRunner, now: float) -> dict[str, object]:
    """The worker's row of the stats page. Its policy is the one it runs under: a published
    version its sampler refused is reported as refused (with why), not as its version."""
    policy = runner.applied
    return {
        "worker": runner.worker,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "gpu": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        "sampler": runner.sampler.name,
        "batches": runner.batches,
        "busy_s": round(runner.busy_s, 3),
        "estimate_ms": round(runner.estimate_ms, 2),
        "policy_version": runner.applied_version,
        "policy_refused": runner.refused_version,
        "policy_refused_reason": runner.refused_reason,
        "max_batch_size": policy.max_batch_size,
        "max_new_tokens": runner.sampler.generation.max_new_tokens,
        "state": "busy" if runner.busy_since is not None else "idle",
        "heartbeat_at": now,
    }


def say_goodbye(runner: BatchRunner, state: str = "stopped") -> None:
    """Stop counting as a live worker at once (not 5 s later), and show as stopped (or hung),
    not as silent, on the stats page. Best effort: the process is leaving."""
    aggregator = runner.aggregator
    info_key = aggregator.keys.worker_info(runner.worker)
    try:
        runner.workers.forget(runner.worker)
        raw = aggregator.client.get(info_key)
        if raw:
            info = {**json.loads(raw), "state": state, "heartbeat_at": time.time()}
            aggregator.client.set(info_key, json.dumps(info), px=WORKER_INFO_TTL_MS)
    except (redis.RedisError, ValueError) as exc:
        log.warning(
            "worker %s leaves without saying so in Redis (counted for up to %d ms more): %s",
            runner.worker,
            HEARTBEAT_TIMEOUT_MS,
            exc,
        )


def flush_logs() -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
