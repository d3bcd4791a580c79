"""Statistics counts sent to Redis exactly once, in the node's time (batching/lua/flush_stats.lua).

A process (a web process's RequestStats, a worker's batch counts) hands its counts, per second
of its own clock, to a `Flusher`. Each hand-over becomes a flush with the next sequence number
of this writer (a random id per process), kept in memory until Redis has applied it:

- A flush whose reply is lost (a socket timeout after Redis applied it, a connection cut) is
  sent again as it was, same sequence: the script applies a writer's sequence once, so it is
  counted once. Flushes go in order and a later one waits for an earlier one: the per-writer
  high-water mark is all Redis keeps (one hash field per process, not a key per flush).
- The script moves each second by the writer's offset to the node's clock (whole seconds), so
  a process whose clock is off still counts in the node's minute.
- A count landing in a minute housekeeping already persisted marks that minute dirty, and
  housekeeping writes the minute's totals again (operations/housekeeping.py).
- A key's spend is also added to its month's total (by the writer's clock's UTC month), in
  the same script: what the keys' monthly budgets are checked against (accounts.budgets).

At most MAX_UNSENT flushes wait in memory (Redis away that long): beyond, the oldest are
dropped with an error logged (the loss bound of a Redis outage, docs/guides/usage.md).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis

from batching import scripts
from batching.keys import AccessKeys, QueueKeys

log = logging.getLogger(__name__)

# Flushes kept while Redis is away: an hour of a web process's once-a-second flushes.
MAX_UNSENT = 3600
# How long Redis keeps the 1-second and 10-second buckets (and the flush bookkeeping).
SECOND_TTL_S = 15 * 60
TEN_SECONDS_TTL_S = 2 * 3600 + 600

Counts = Mapping[int, Mapping[str, int]]  # second (the writer's clock) -> field -> count


# How long a month's spend totals stay in Redis (the budgets of its keys read them).
MONTH_TTL_S = 62 * 24 * 3600
# A key's spend field in the counts ("k:<key id>:spend", telemetry.stats), which the flush
# also adds to its month's total per key (QueueKeys.spend_of_month).
SPEND_FIELD = re.compile(r"^k:(\d+):spend$")


# How often a writer notes its queue among a month's models with spend (note_spent).
NOTE_EVERY_S = 60.0


def note_spent(client: redis.Redis, month: str, queue: str, keys: AccessKeys | None = None) -> None:
    """`queue` among the models with spend in `month`: what budgets sum over."""
    name = (keys or AccessKeys()).spent_models(month)
    with client.pipeline(transaction=False) as pipe:
        pipe.sadd(name, queue)
        pipe.expire(name, MONTH_TTL_S)
        pipe.execute()


def month_of(second: float) -> str:
    """The UTC month of an epoch second: "2026-11"."""
    return datetime.fromtimestamp(second, tz=UTC).strftime("%Y-%m")


def monthly_spend(counts: Mapping[int, Mapping[str, int]]) -> dict[str, dict[str, int]]:
    """month -> key id -> spend, from the keys' spend fields of `counts` (by second)."""
    found: dict[str, dict[str, int]] = {}
    for second, fields in counts.items():
        for name, value in fields.items():
            match = SPEND_FIELD.match(name)
            if match and value:
                by_key = found.setdefault(month_of(second), {})
                by_key[match.group(1)] = by_key.get(match.group(1), 0) + value
    return found


@dataclass(frozen=True)
class Unsent:
    sequence: int
    counts: dict[int, dict[str, int]]

    def requests(self) -> int:
        return sum(v for c in self.counts.values() for k, v in c.items() if k.startswith("req:"))


class Flusher:
    """One writer's flushes of one queue's statistics: `add` them, `send` them (again)."""

    def __init__(
        self,
        queue: str,
        clock: Callable[[], float] = time.time,
        max_unsent: int = MAX_UNSENT,
        writer: str = "",
        sequence: int = 0,
        applied: str = "",
        applied_ttl_s: int = 0,
    ) -> None:
        """`writer` and `sequence`: a writer that keeps its own (an offline job's charges:
        offline.charges), whose next flush is `sequence` + 1; by default a new random id.
        `applied` and `applied_ttl_s`: where its last applied sequence is kept, and how long
        (by default the queue's hash of every writer's, as long as the 10-second buckets)."""
        self.queue = queue
        self.keys = QueueKeys(queue)
        self._noted: dict[str, float] = {}  # month -> when this writer last noted its spend
        self.applied = applied or self.keys.stats_applied
        self.applied_ttl_s = applied_ttl_s
        self.clock = clock  # this process's clock: what its seconds are counted by
        self.writer = writer or uuid.uuid4().hex
        self.max_unsent = max_unsent
        self._sequence = sequence
        self._unsent: deque[Unsent] = deque()
        self._lock = threading.Lock()
        self._sending = threading.Lock()
        self._scripts: dict[int, Any] = {}

    def add(self, counts: Counts) -> None:
        """Queue `counts` as the next flush (nothing when empty)."""
        kept = {int(s): {f: int(v) for f, v in c.items() if v} for s, c in counts.items()}
        kept = {second: fields for second, fields in kept.items() if fields}
        if not kept:
            return
        with self._lock:
            self._sequence += 1
            self._unsent.append(Unsent(self._sequence, kept))
            while len(self._unsent) > self.max_unsent:
                lost = self._unsent.popleft()
                log.error("statistics flush %d dropped: Redis away too long", lost.sequence)

    @property
    def unsent(self) -> int:
        return len(self._unsent)

    def send(self, client: redis.Redis, clock_ms: int | None = None) -> int:
        """Send every unsent flush, oldest first, each until Redis has applied it; returns the
        requests they counted. An error stops here: what is left goes again with the next
        `send`, as it was."""
        sent = 0
        with self._sending:
            while self._unsent:
                flush = self._unsent[0]
                spend = monthly_spend(flush.counts)
                self._script(client)(
                    keys=[self.applied, self.keys.persisted_minute, self.keys.dirty_minutes],
                    args=[self.writer, flush.sequence, repr(self.clock()),
                          json.dumps(list(flush.counts.items()), separators=(",", ":")),
                          self.keys.stats_prefix, SECOND_TTL_S, TEN_SECONDS_TTL_S,
                          "" if clock_ms is None else clock_ms,
                          json.dumps(spend, separators=(",", ":")) if spend else "",
                          self.keys.spend_prefix, MONTH_TTL_S, self.applied_ttl_s or ""],
                )  # fmt: skip
                with self._lock:
                    if self._unsent and self._unsent[0] is flush:
                        self._unsent.popleft()
                sent += flush.requests()
                self._note_spent(client, spend)
        return sent

    def _note_spent(self, client: redis.Redis, spend: Mapping[str, object]) -> None:
        """This queue among the models with spend in each month of `spend` (again once a
        minute: Redis may have lost the set since)."""
        now = time.monotonic()
        for month in spend:
            if now - self._noted.get(month, -NOTE_EVERY_S) >= NOTE_EVERY_S:
                note_spent(client, month, self.queue)
                self._noted[month] = now

    def _script(self, client: redis.Redis) -> Any:
        found = self._scripts.get(id(client))
        if found is None:
            found = self._scripts[id(client)] = scripts.register(client, "flush_stats")
        return found
