"""Set times for the tests of the aggregator's scripts: they take the time (ms) as an argument,
and an aggregator takes the monotonic clock it reads."""

from __future__ import annotations

import time

import redis


def redis_ms(client: redis.Redis) -> int:
    """The Redis node's time now, in ms: where a test's set times start (keys still expire in
    the node's own time)."""
    seconds, micros = client.time()
    return int(seconds * 1000 + micros // 1000)


class SetClock:
    """A process's monotonic clock that the test moves: `skew_s` ahead of the real one, or of
    the moment it was made when `frozen`."""

    def __init__(self, frozen: bool = True) -> None:
        self.frozen_s = time.monotonic() if frozen else None
        self.skew_s = 0.0

    def __call__(self) -> float:
        return (time.monotonic() if self.frozen_s is None else self.frozen_s) + self.skew_s
