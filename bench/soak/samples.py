"""What the soak samples every few seconds: the RSS of every process, and Redis' keys and
memory (bench.soak)."""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections import Counter

import psutil
import redis

from bench.harness.stack import Stack
from bench.soak.verdict import SAMPLE_EVERY_S, STATS_KEY, Samples
from devstack.embedded_redis import EmbeddedRedis


def _processes(stack: Stack, server: EmbeddedRedis) -> dict[int, str]:
    found: dict[int, str] = {}
    if stack.web is not None and stack.web.poll() is None:
        found[stack.web.pid] = "gunicorn master"
        with_children = psutil.Process(stack.web.pid).children()
        for number, child in enumerate(sorted(with_children, key=lambda p: p.pid)):
            found[child.pid] = f"web process {number + 1}"
    for worker in stack.workers:
        if worker.poll() is None:
            found[worker.pid] = "celery worker"
    if server.process is not None and server.process.poll() is None:
        found[server.process.pid] = "redis-server"
    return found


def sample(stack: Stack, server: EmbeddedRedis, samples: Samples, stop: threading.Event) -> None:
    client = redis.Redis.from_url(server.url, socket_timeout=1, socket_connect_timeout=1)
    while not stop.wait(SAMPLE_EVERY_S):
        now = time.monotonic()
        for pid, name in _processes(stack, server).items():
            try:
                rss = psutil.Process(pid).memory_info().rss
            except psutil.Error:
                continue
            if not rss:
                continue  # exited, not yet reaped: no memory to judge
            samples.rss.setdefault(pid, (name, now, []))[2].append((now, rss))
        with contextlib.suppress(redis.RedisError):  # down: restarted meanwhile
            samples.redis.append((now, *_redis_figures(client)))


def _redis_figures(client: redis.Redis) -> tuple[int, int, int, int]:
    """The bytes and number of Redis' keys that follow traffic (batches, items, results,
    counters, heartbeats...); the number of statistics buckets, which grow with time until
    their TTL (telemetry.stats.TTL_S: 15 minutes of seconds, 2 hours of 10 seconds) and are
    judged by that bound, not here; and INFO's used_memory, for the record."""
    traffic, buckets = [], 0
    for key in client.scan_iter(count=1000):
        if STATS_KEY.search(key.decode(errors="replace")):
            buckets += 1
        else:
            traffic.append(key)
    with client.pipeline(transaction=False) as pipe:
        for key in traffic:
            pipe.memory_usage(key)
        sizes = pipe.execute()
    used = int(client.info("memory")["used_memory"])
    return sum(size or 0 for size in sizes), len(traffic), buckets, used


def key_kinds(url: str) -> dict[str, int]:
    """Redis' keys by their name less ids and numbers: what a growing key count is made of."""
    kinds: Counter[str] = Counter()
    for key in redis.Redis.from_url(url).scan_iter(count=1000):
        name = key.decode(errors="replace")
        kinds[re.sub(r"[0-9a-f]{12,}|\d+", "#", name)] += 1
    return dict(kinds.most_common(12))
