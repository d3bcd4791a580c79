"""What operators, tests and the benchmark read of a queue's past batches: the last batches'
records, their statistics, and how long a batch's turn on a GPU takes."""

from __future__ import annotations

from collections.abc import Mapping

import redis

from batching.keys import QueueKeys
from telemetry import stats

# The last batch records kept for operators, tests and the benchmark.
BATCH_LOG_LENGTH = 1000
# The turn time is kept this many batch lifetimes: a stale figure must not outlive the workers
# long.
TURN_MS_KEEP_TTLS = 5


class BatchLog:
    """A queue's batch log and turn time."""

    def __init__(self, client: redis.Redis, queue: str) -> None:
        self.client = client
        self.queue = queue
        self.keys = QueueKeys(queue)

    def queue_record(
        self, pipe: redis.client.Pipeline, record: str, counts: Mapping[str, int], at_s: float
    ) -> None:
        """Queue on `pipe` a batch's record (JSON; the last BATCH_LOG_LENGTH are kept for
        operators, tests and the benchmark) and its statistics `counts`, added to the time
        buckets of `at_s`."""
        pipe.lpush(self.keys.batch_log, record)
        pipe.ltrim(self.keys.batch_log, 0, BATCH_LOG_LENGTH - 1)
        stats.add_counts(pipe, self.queue, at_s, counts)

    def recent(self, count: int = BATCH_LOG_LENGTH) -> list[bytes]:
        """The last `count` batches' records (JSON), newest first."""
        return list(self.client.lrange(self.keys.batch_log, 0, count - 1))

    def queue_turn_ms(self, pipe: redis.client.Pipeline, turn_ms: float, batch_ttl_ms: int) -> None:
        """Queue on `pipe` how long a batch's turn on a GPU takes, for operators; it is kept a
        few batch lifetimes (`batch_ttl_ms`, the aggregator's)."""
        pipe.set(self.keys.turn_ms, max(1, round(turn_ms)), px=batch_ttl_ms * TURN_MS_KEEP_TTLS)

    def publish_turn_ms(self, turn_ms: float, batch_ttl_ms: int) -> None:
        with self.client.pipeline(transaction=False) as pipe:
            self.queue_turn_ms(pipe, turn_ms, batch_ttl_ms)
            pipe.execute()

    def published_turn_ms(self) -> float:
        return published_turn_ms(self.client, self.keys)


def published_turn_ms(client: redis.Redis, keys: QueueKeys) -> float:
    """The workers' running estimate of a call (ms), 0 before any."""
    raw = client.get(keys.turn_ms)
    return float(raw) if raw else 0.0
