"""A process's view of each Redis node's time: items' deadlines and batches' times are in the
time of the node that holds them, so web and GPU nodes need no shared clock."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis

from batching import scripts
from batching.keys import ShardKeys

# A process reads a shard's Redis time this often (its clock offset), with this many TIME
# round trips, keeping the tightest.
CLOCK_REFRESH_S = 10.0
CLOCK_SAMPLES = 3


class RedisClock:
    """Each shard's Redis time in ms, from this process's monotonic clock and an offset read
    with TIME every CLOCK_REFRESH_S.

    Never ahead of the node's clock: TIME ran at some point of its round trip, so the node's
    time minus the round trip's end is a lower bound of the offset, and the largest of
    CLOCK_SAMPLES such bounds the tightest. A midpoint could be ahead by half a round trip,
    and a first round trip that also connects and loads the script, under gevent on busy
    cores, can take tens of ms: a request's deadline then lay that much past its budget in the
    node's time, and a worker sampled items it should have dropped, answering after their
    requests had given up."""

    def __init__(
        self, client: redis.Redis, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self.script: Any = scripts.register(client, "clock")
        self._monotonic = monotonic
        # Per shard tag: (Redis ms - monotonic ms, when read).
        self._offsets: dict[str, tuple[float, float]] = {}

    def now_ms(self, keys: ShardKeys, now_s: float | None = None) -> int:
        """The shard's Redis time in ms at monotonic time `now_s` (None: now)."""
        offset = self._offsets.get(keys.tag)
        now = self._monotonic() if now_s is None else now_s
        if offset is None or now - offset[1] > CLOCK_REFRESH_S:
            bounds = []
            for _ in range(CLOCK_SAMPLES):
                seconds, micros = self.script(keys=[keys.open_batch])
                now = self._monotonic()
                bounds.append(int(seconds) * 1000 + int(micros) / 1000 - now * 1000)
            offset = self._offsets[keys.tag] = (max(bounds), now)
        return int(now * 1000 + offset[0])
