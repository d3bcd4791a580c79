"""The backfill lane: offline jobs' requests (the Batch API, offline.*) carried in the places
that interactive batches leave empty, and in whole batches on GPUs that would be idle.

Per shard of a queue (ShardKeys): `backfill`, a list of items; `backfill_taken`, a zset of
the items seals took, scored by when (ms); `backfill_done`, a list of their answers.

- A seal (batching/lua/seal.lua) tops the batch it takes up with backfill items, into the
  places its interactive items left empty, never more: an interactive item is never
  displaced, and no seal waits for one. A worker whose GPU would be idle seals a backfill
  turn (BACKFILL_TURN), which takes an interactive batch as any task would when one is
  waiting, and else a whole batch of backfill items.
- A seal's top-up may not lengthen the interactive call past a bound on the worker's cost
  profile (workers.runner): the items it took that do not fit go back to the lane's tail in
  one script (batching/lua/return_backfill.lua), for a later call or a backfill turn.
- A worker answers a taken item in the pipeline of its batch's record, in one script
  (batching/lua/answer_backfill.lua): its answer onto `backfill_done`, the item off
  `backfill_taken`.
- The feeder (one process per deployment at a time: offline.feeder) pushes a job's items,
  collects the answers, and puts back the items taken longer than TAKEN_TIMEOUT_MS ago (their
  worker died, or their answer was lost with Redis). So an item may be answered twice, but is
  never lost: its job keeps one answer per line. The feeder trims the answers it wrote under
  its holding's generation (batching/lua/trim_done.lua): a feeder that stalled past its lock
  cannot trim answers its successor read and did not write yet.

Admission and the GPU recommendation never see the backfill lane: it only ever fills what
interactive traffic leaves.

Django-free: what a job is, is the feeder's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache

import redis

from batching import scripts
from batching.answers import Answer
from batching.generation import SampleRequest
from batching.items import Item
from batching.keys import ShardKeys

# A taken item not answered within this long goes back to the lane: far longer than a call
# may run before its worker is cut off as hung.
TAKEN_TIMEOUT_MS = 60_000
# What a backfill item's deadline reads as: none (it never expires before its call).
NO_DEADLINE_MS = 2**62
# The key a backfill item's row counts its tokens under: none of the API keys (0 is the
# anonymous callers'), so that no rate window is charged with them.
NO_KEY = -1


@dataclass(frozen=True)
class BackfillItem:
    """One line of an offline job: its job's id, its line (from 0), and its request."""

    job: str
    line: int
    request: SampleRequest

    def wire(self) -> str:
        return f"{self.job} {self.line}:{self.request.to_json()}"

    @classmethod
    def parse(cls, raw: bytes | str) -> BackfillItem:
        text = raw.decode() if isinstance(raw, bytes) else raw
        head, _, request = text.partition(":")
        job, _, line = head.partition(" ")
        return cls(job, int(line), SampleRequest.from_json(request))

    def as_item(self) -> Item:
        """As a sampler's row is made of it: no deadline; no key (its tokens are its job's
        usage, not any key's rate window)."""
        return Item(NO_DEADLINE_MS, "", self.request, key_id=NO_KEY)


@dataclass(frozen=True)
class Done:
    """A backfill item's answer, as the feeder collects it."""

    job: str
    line: int
    answer: Answer

    def wire(self) -> str:
        return json.dumps([self.job, self.line, self.answer.to_wire()])

    @classmethod
    def parse(cls, raw: bytes | str) -> Done:
        job, line, answer = json.loads(raw)
        return cls(str(job), int(line), Answer.from_wire(answer))


def queue_answers(
    pipe: redis.client.Pipeline,
    keys: ShardKeys,
    taken: Sequence[bytes],
    items: Sequence[BackfillItem],
    answers: Sequence[Answer],
) -> None:
    """Queue on `pipe` the answers of the backfill items a seal of `keys`' shard took (their
    raw strings `taken`): onto the done list and off the taken set in one script, so that a
    pipeline cut short, a crash or a failover leaves each line either answered or taken (and
    so put back in time), never neither."""
    if not taken:
        return
    done = [Done(i.job, i.line, a).wire() for i, a in zip(items, answers, strict=True)]
    keys_and_args = [keys.backfill_done, keys.backfill_taken, len(done), *done, *taken]
    pipe.eval(_source("answer_backfill"), 2, *keys_and_args)  # EVAL: a pipeline of any client


def queue_give_back(pipe: redis.client.Pipeline, keys: ShardKeys, taken: Sequence[bytes]) -> None:
    """Queue on `pipe` the return to `keys`' lane (its tail) of the backfill items a seal took
    that its call leaves out, off the taken set in the same script."""
    if taken:
        pipe.eval(_source("return_backfill"), 2, keys.backfill, keys.backfill_taken, *taken)


@cache
def _source(name: str) -> str:
    return scripts.source(name)


class StaleFeeder(Exception):
    """A later holder of the feeder's lock fenced a done list: this one may not trim it."""


class Backfill:
    """The backfill lane of one queue's shards, as the feeder uses it."""

    def __init__(
        self, client: redis.Redis, shards: Sequence[ShardKeys], generation: int = 0
    ) -> None:
        self.client = client
        self.shards = list(shards)
        self.generation = generation  # the feeder's holding: batching/lua/trim_done.lua
        self._trim = scripts.register(client, "trim_done")
        self._withdraw = scripts.register(client, "withdraw")
        self._jobs_held = scripts.register(client, "jobs_held")
        self._next = 0

    def push(self, items: Iterable[BackfillItem]) -> int:
        """Append items to the shards' lanes in turn; how many."""
        by_shard: list[list[str]] = [[] for _ in self.shards]
        count = 0
        for item in items:
            by_shard[self._next].append(item.wire())
            self._next = (self._next + 1) % len(self.shards)
            count += 1
        with self.client.pipeline(transaction=False) as pipe:
            for keys, wires in zip(self.shards, by_shard, strict=True):
                if wires:
                    pipe.rpush(keys.backfill, *wires)
            pipe.execute()
        return count

    def depth(self) -> tuple[int, int]:
        """Items waiting in the lanes, and items taken and not answered yet."""
        with self.client.pipeline(transaction=False) as pipe:
            for keys in self.shards:
                pipe.llen(keys.backfill)
                pipe.zcard(keys.backfill_taken)
            counts = pipe.execute()
        return sum(counts[0::2]), sum(counts[1::2])

    def collect(self, at_most: int) -> tuple[list[Done], list[int]]:
        """Up to `at_most` answers of each shard, and how many of each shard's were read:
        they stay in the lists until `acknowledge`d (the feeder acknowledges what it wrote),
        so a feeder that fails on the way reads them again. Each shard is fenced with this
        holding's generation first; StaleFeeder when a later holder fenced one."""
        found = []
        for keys in self.shards:
            self._fence(keys, 0)
            found.append(self.client.lrange(keys.backfill_done, 0, at_most - 1))
        answers = [Done.parse(raw) for batch in found for raw in batch]
        return answers, [len(batch) for batch in found]

    def acknowledge(self, read: Sequence[int]) -> None:
        """Drop the answers `collect` read (workers only append): StaleFeeder, and nothing
        dropped from that shard on, when a later holder of the lock fenced one."""
        for keys, count in zip(self.shards, read, strict=True):
            if count:
                self._fence(keys, count)

    def _fence(self, keys: ShardKeys, trim: int) -> None:
        args = [self.generation, trim]
        if self._trim(keys=[keys.backfill_done, keys.backfill_fence], args=args) == -1:
            raise StaleFeeder(f"a later feeder fenced {keys.backfill_done}")

    def requeue_stale(self, now_ms: int, timeout_ms: int = TAKEN_TIMEOUT_MS) -> int:
        """Put back, first in line, the items taken more than `timeout_ms` ago; how many."""
        moved = 0
        for keys in self.shards:
            stale = self.client.zrangebyscore(keys.backfill_taken, "-inf", now_ms - timeout_ms)
            if not stale:
                continue
            with self.client.pipeline(transaction=True) as pipe:
                pipe.zrem(keys.backfill_taken, *stale)
                pipe.lpush(keys.backfill, *stale)
                pipe.execute()
            moved += len(stale)
        return moved

    def withdraw(self, job: str) -> tuple[int, int]:
        """Remove a job's waiting items from the lanes (a cancel); returns how many were
        removed, and how many of its items are still taken (their calls running)."""
        prefix = f"{job} ".encode()
        removed = still_taken = 0
        for keys in self.shards:
            removed += int(self._withdraw(keys=[keys.backfill], args=[prefix]))
            taken = self.client.zrange(keys.backfill_taken, 0, -1)
            still_taken += sum(1 for raw in taken if raw.startswith(prefix))
        return removed, still_taken

    def in_calls(self, job: str) -> int:
        """A job's items taken by calls, or answered and not collected yet (both small)."""
        taken_prefix, done_prefix = f"{job} ".encode(), json.dumps([job])[:-1].encode() + b","
        count = 0
        for keys in self.shards:
            taken = self.client.zrange(keys.backfill_taken, 0, -1)
            count += sum(1 for raw in taken if raw.startswith(taken_prefix))
            done = self.client.lrange(keys.backfill_done, 0, -1)
            count += sum(1 for raw in done if raw.startswith(done_prefix))
        return count

    def jobs_held(self) -> set[str]:
        """The jobs with an item waiting, taken or answered in any shard (one scan each)."""
        held: set[str] = set()
        for keys in self.shards:
            lists = [keys.backfill, keys.backfill_taken, keys.backfill_done]
            held.update(raw.decode() for raw in self._jobs_held(keys=lists))
        return held
