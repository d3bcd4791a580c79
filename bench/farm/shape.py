"""The farm's shape: its topologies, its workers and their pace, --slow-motion's values and
the bar it is held to."""

from __future__ import annotations

from dataclasses import dataclass

CALL_MS = 100
GPUS = 4
WEB_NODES = 2
ONE_REDIS = "one Redis"
CLUSTER = "3 shards, 3-master cluster"
TOPOLOGIES = [ONE_REDIS, CLUSTER]
CHOSEN = {"both": TOPOLOGIES, "one": [ONE_REDIS], "cluster": [CLUSTER]}
CLUSTER_SHARDS = 3
SLOWED = 20  # --slow-motion: calls and deadlines this many times the production farm's
SLOW_MOTION = {"gpus": 21, "call_ms": 100 * SLOWED, "deadline_ms": 500 * SLOWED,
               "rate": 20_000 / SLOWED, "seconds": 60.0, "rounds": 1}  # fmt: skip
OK_BAR_PERCENT = 99.9  # --slow-motion's bar: answered 200 at least, and no other answer


@dataclass(frozen=True)
class Shape:
    """The farm's workers and their pace: `gpus` simulated workers, `call_ms` a call, and
    `deadline_ms` deadlines (None: the service's default)."""

    gpus: int = GPUS
    call_ms: int = CALL_MS
    deadline_ms: int | None = None

    @property
    def client_timeout_s(self) -> float:
        """The client waits past any deadline: an answer it gives up on counts as other."""
        return max(3.0, (self.deadline_ms or 0) / 1000 + 2.0)
