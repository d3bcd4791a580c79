"""The timed sampler's log of calls, read back, and when results are published (bench.gap)."""

from __future__ import annotations

import http.client
import itertools
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import redis


@dataclass(frozen=True)
class Call:
    start: float  # epoch seconds, as the worker's clock reads them
    end: float
    size: int
    first_prompt: str

    @property
    def ms(self) -> float:
        return (self.end - self.start) * 1000


def read_calls(path: Path, prefix: str) -> list[Call]:
    calls = []
    for line in path.read_text().splitlines():
        start, end, size, prompt = line.split(" ", 3)
        if prompt.startswith(prefix):
            calls.append(Call(float(start), float(end), int(size), prompt))
    return sorted(calls, key=lambda call: call.start)


def gaps_ms(calls: list[Call]) -> list[float]:
    return [(after.start - before.end) * 1000 for before, after in itertools.pairwise(calls)]


class ResultTimes:
    """When each awaited result is published, as a subscriber of its channel sees it."""

    def __init__(self, redis_url: str, task_ids: list[str]) -> None:
        self.times: dict[str, float] = {}
        self._pubsub = redis.Redis.from_url(redis_url).pubsub(ignore_subscribe_messages=True)
        self._pubsub.subscribe(*(f"celery-task-meta-{task_id}" for task_id in task_ids))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while not self._stop.is_set():
            message = self._pubsub.get_message(timeout=0.1)
            if message is not None:
                at = time.time()
                channel = message["channel"].decode()
                self.times.setdefault(channel.removeprefix("celery-task-meta-"), at)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._pubsub.close()


def post(port: int, prompt: str) -> tuple[int, str]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("POST", "/sample", body=prompt.encode())
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()
