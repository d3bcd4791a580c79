"""The fixed costs around a GPU call that the capacity planner simulates with, as measured.

`python -m bench gap --write-costs` (bench/gap/) measures them on real processes and writes
planning/costs.json, with the date, machine and command of the measurement:
  gap_ms       a worker's time from the end of one call to the start of the next, with work
               queued: its median under open-loop load above saturation;
  dispatch_ms  a lone request's trip from the client's send to its call's start (web process,
               the batch's Redis append, the task's trip through Redis and Celery, the seal):
               median, one request at a time;
  path_ms      a call's end to the answer at the client (the answers' publication, the web
               process's wake-up, the response): median, one request at a time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

COSTS_FILE = Path(__file__).with_name("costs.json")


@dataclass(frozen=True)
class Provenance:
    """When, where and by which command a stored figure was measured."""

    measured: str  # the date
    machine: str
    command: str

    @staticmethod
    def read(raw: dict[str, object]) -> dict[str, str]:
        return {name: str(raw[name]) for name in ("measured", "machine", "command")}

    @property
    def source(self) -> str:
        return f"measured by `{self.command}` on {self.measured} ({self.machine})"


@dataclass(frozen=True)
class MeasuredCosts(Provenance):
    gap_ms: float
    dispatch_ms: float
    path_ms: float

    @classmethod
    def load(cls, path: Path = COSTS_FILE) -> MeasuredCosts:
        raw = json.loads(path.read_text())
        return cls(
            gap_ms=float(raw["gap_ms"]),
            dispatch_ms=float(raw["dispatch_ms"]),
            path_ms=float(raw["path_ms"]),
            **cls.read(raw),
        )


MEASURED = MeasuredCosts.load()


SHARD_CEILING_FILE = Path(__file__).with_name("shard_ceiling.json")


@dataclass(frozen=True)
class ShardCeiling(Provenance):
    """The requests/s one shard of the request path (one Redis process) carries while the
    request's round trip stays under 5 ms at p99 (docs/benchmarks/redis-cost.md: how)."""

    shard_rps: float

    @classmethod
    def load(cls, path: Path = SHARD_CEILING_FILE) -> ShardCeiling:
        raw = json.loads(path.read_text())
        return cls(shard_rps=float(raw["shard_rps"]), **cls.read(raw))


# None without shard_ceiling.json: the planner then asks for --redis-shard-rps.
MEASURED_SHARD = ShardCeiling.load() if SHARD_CEILING_FILE.exists() else None
