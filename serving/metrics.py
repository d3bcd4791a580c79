"""Prometheus metrics of the service, served by every web node at GET /metrics.

- Web processes count requests in prometheus_client's multiprocess mode: gunicorn sets
  PROMETHEUS_MULTIPROC_DIR before its workers start (inference_site/gunicorn.conf.py), each
  process writes its own file, and /metrics sums them, so any process's answer covers all.
- The GPU-count recommendation of the queue (telemetry.recommendation), computed at each scrape
  from the last minute in Redis: `sampling_gpus_recommended` and `sampling_gpus_live`, the
  signal an autoscaler scales the workers on (deploy/k8s/). Every web node answers the same.
- Workers run on other machines: each one publishes its own metrics (workers/metrics.py) to
  Redis with its heartbeat, once a second, and /metrics adds them, labelled by worker. So
  one scrape of any web node shows the whole queue; workers serve no port of their own.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import redis
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from batching.keys import QueueKeys
from batching.outcomes import RequestOutcome
from batching.policy import Policy
from batching.registry import HEARTBEAT_TIMEOUT_MS
from batching.topology import REDIS_FAULTS
from telemetry.recommendation import observed
from telemetry.stats import KNOWN_WORKERS_S

LATENCY_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.75,
    1.0, 1.5, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

REQUESTS = Counter(
    "sampling_requests", "Requests to /sample, by outcome (ok: a completion returned)", ["outcome"]
)
REQUEST_LATENCY = Histogram(
    "sampling_request_latency_seconds",
    "Time from a /sample request's arrival to its answer, any outcome",
    buckets=LATENCY_BUCKETS_S,
)
# One child per outcome, made once: a label lookup per request costs more than the increment.
REQUESTS_BY_OUTCOME = {outcome: REQUESTS.labels(outcome=outcome) for outcome in RequestOutcome}

# Per tier (the caller's: a key's tier, "anonymous" without one): requests by outcome, whose
# "ok" rate is the tier's goodput, and latency. Children made on a tier's first request.
TIER_REQUESTS = Counter(
    "sampling_tier_requests",
    "Requests by the caller's tier and outcome (ok: a completion returned)",
    ["tier", "outcome"],
)
TIER_LATENCY = Histogram(
    "sampling_tier_request_latency_seconds",
    "Time from a request's arrival to its answer, any outcome, by the caller's tier",
    ["tier"],
    buckets=LATENCY_BUCKETS_S,
)
# Streams (serving.streams), named after vLLM's: from a request's arrival to its first
# content chunk, between two content chunks of a choice (a chunk carries what its worker
# sampled since the last one: a token or a few), and to the stream's end.
TOKEN_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
)  # fmt: skip
TIME_TO_FIRST_TOKEN = Histogram(
    "sampling_time_to_first_token_seconds",
    "Streams: time from a request's arrival to its first content chunk",
    buckets=TOKEN_LATENCY_BUCKETS_S,
)
INTER_TOKEN_LATENCY = Histogram(
    "sampling_inter_token_latency_seconds",
    "Streams: time between two content chunks of a choice",
    buckets=TOKEN_LATENCY_BUCKETS_S,
)
E2E_STREAM_LATENCY = Histogram(
    "sampling_e2e_request_latency_seconds",
    "Streams: time from a request's arrival to its stream's last event, any outcome",
    buckets=LATENCY_BUCKETS_S,
)
SHED_REQUESTS = Counter(
    "sampling_shed_requests",
    "Requests refused by their web process before any work (503): late, or too many in flight",
    ["reason"],
)
_tier_children: dict[tuple[str, RequestOutcome], tuple[Any, Any]] = {}


CACHE_LOOKUPS = Counter(
    "sampling_cache_lookups",
    "Items the response cache was asked for, by result (hit: answered from the cache, no GPU)",
    ["result"],
)
CACHE_RESULTS = {result: CACHE_LOOKUPS.labels(result=result) for result in ("hit", "miss")}


def record_cache(hits: int, misses: int) -> None:
    if hits:
        CACHE_RESULTS["hit"].inc(hits)
    if misses:
        CACHE_RESULTS["miss"].inc(misses)


def record_first_token(seconds: float) -> None:
    TIME_TO_FIRST_TOKEN.observe(seconds)


def record_inter_token(seconds: float) -> None:
    INTER_TOKEN_LATENCY.observe(seconds)


def record_stream_end(seconds: float) -> None:
    E2E_STREAM_LATENCY.observe(seconds)


def record_request(outcome: RequestOutcome, latency_s: float, tier: str = "") -> None:
    REQUESTS_BY_OUTCOME[outcome].inc()
    REQUEST_LATENCY.observe(latency_s)
    if tier:
        children = _tier_children.get((tier, outcome))
        if children is None:
            children = _tier_children[tier, outcome] = (
                TIER_REQUESTS.labels(tier=tier, outcome=outcome),
                TIER_LATENCY.labels(tier=tier),
            )
        children[0].inc()
        children[1].observe(latency_s)


class WorkerMetricsCollector:
    """The workers' published expositions, merged family by family."""

    def __init__(self, client: redis.Redis, queues: Sequence[str]) -> None:
        self.client = client
        self.queues = [QueueKeys(queue) for queue in queues]

    def texts(self) -> list[str]:
        found = []
        for keys in self.queues:
            workers = self.client.zrange(
                keys.known_workers, int(time.time() - KNOWN_WORKERS_S), "+inf", byscore=True
            )
            if workers:
                texts = self.client.mget([keys.worker_metrics(w.decode()) for w in workers])
                found += [text.decode() for text in texts if text is not None]
        return found

    def collect(self) -> list[Metric]:
        families: dict[str, Metric] = {}
        for text in self.texts():
            for family in text_string_to_metric_families(text):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                merged.samples.extend(family.samples)
        return list(families.values())


class CapacityCollector:
    """Each model's GPU recommendation, live GPUs and GPU time per request, read from Redis at
    each scrape."""

    def __init__(self, client: redis.Redis, models: Sequence[tuple[str, Policy]]) -> None:
        self.client = client
        self.models = models

    def collect(self) -> list[Metric]:
        recommended = GaugeMetricFamily(
            "sampling_gpus_recommended",
            "GPUs (workers) the demand of the last minute's busiest 10 s needs at the fill target",
            labels=["queue"],
        )
        live = GaugeMetricFamily(
            "sampling_gpus_live",
            f"Workers of the queue that heartbeated in the last {HEARTBEAT_TIMEOUT_MS / 1000:g} s",
            labels=["queue"],
        )  # fmt: skip
        cost = GaugeMetricFamily(
            "sampling_gpu_ms_per_request",
            "Live GPUs' time per request that asked them over the last minute (ms): what a "
            "request costs; a full batch's call time over its size at best",
            labels=["queue"],
        )
        for queue, policy in self.models:
            advice = observed(self.client, queue, policy)
            recommended.add_metric([queue], advice.needed_gpus)
            live.add_metric([queue], advice.live_gpus)
            if advice.rate_rps > 0:
                cost.add_metric([queue], 1000 * advice.live_gpus / advice.rate_rps)
        return [recommended, live, cost]


# The feeder's steps whose failures are counted (offline.feeder, offline.validate).
JOB_STEPS = ("validated", "moved on", "finalized", "charged")


class JobFailuresCollector:
    """How many times a step of an offline job failed in the feeder (offline.feeder), by
    step, read from Redis at each scrape."""

    def __init__(self, client: redis.Redis, queues: Sequence[str]) -> None:
        self.client = client
        self.queues = queues

    def collect(self) -> list[Metric]:
        failures = CounterMetricFamily(
            "sampling_batch_job_failures",
            "Offline jobs' steps that failed in the feeder, by step (each failure: the step "
            "is tried again on the next run)",
            labels=["step"],
        )
        by_step = dict.fromkeys(JOB_STEPS, 0)  # each step's series, from 0
        for queue in self.queues:
            for step, count in self.client.hgetall(QueueKeys(queue).feeder_failures).items():
                by_step[step.decode()] = by_step.get(step.decode(), 0) + int(count)
        for step, count in sorted(by_step.items()):
            failures.add_metric([step], count)
        return [failures]


def exposition(client: redis.Redis, models: Sequence[tuple[str, Policy]]) -> bytes:
    """This node's web processes (all of them, from the multiprocess files), every worker of
    every model, and each model's GPU recommendation under its policy (the one this node
    applies): `models` is (queue, policy) pairs."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        web = CollectorRegistry()
        MultiProcessCollector(web)
        text = generate_latest(web)
    else:  # one process (manage.py runserver, tests in-process): its default registry
        from prometheus_client import REGISTRY

        text = generate_latest(REGISTRY)
    for name, collector in (
        ("workers' metrics", WorkerMetricsCollector(client, [queue for queue, _ in models])),
        ("GPU recommendation", CapacityCollector(client, models)),
        ("offline jobs' failures", JobFailuresCollector(client, [queue for queue, _ in models])),
    ):
        registry = CollectorRegistry(auto_describe=False)
        registry.register(collector)
        try:
            text += generate_latest(registry)
        except REDIS_FAULTS as exc:  # a cluster's RedisClusterException too
            text += f"# {name} unavailable: Redis error {type(exc).__name__}\n".encode()
    return text


def record_shed(reason: str) -> None:
    SHED_REQUESTS.labels(reason=reason).inc()
