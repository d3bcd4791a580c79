"""A stalled worker: it heartbeats for a queue, as a live worker does, and takes no batch, as
a worker whose GPU hangs between calls would. For the benchmarks and tests whose requests
must wait out their deadline in an open batch: a model with no live worker at all is refused
at once (serving.routing), so "no worker" no longer makes a request wait."""

from __future__ import annotations

import threading
from types import TracebackType

import redis

from batching.keys import QueueKeys
from batching.registry import HEARTBEAT_TIMEOUT_MS, WorkerRegistry

# Well inside the heartbeat timeout, as a worker's own heartbeat is.
BEAT_S = HEARTBEAT_TIMEOUT_MS / 1000 / 5


class StalledWorker:
    """`with StalledWorker(redis_url, queue):` the queue has one live worker that never takes
    a batch; it says goodbye on leaving."""

    def __init__(self, redis_url: str, queue: str, name: str = "stalled@harness") -> None:
        self.registry = WorkerRegistry(redis.Redis.from_url(redis_url), QueueKeys(queue))
        self.name = name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="stalled-worker", daemon=True)

    def __enter__(self) -> StalledWorker:
        self.registry.heartbeat(self.name)
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self.registry.forget(self.name)

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self.registry.heartbeat(self.name)
            except redis.RedisError:  # Redis restarting: the next beat tries again
                continue
