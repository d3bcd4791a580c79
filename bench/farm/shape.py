"""The farm's shape: its topologies, its workers and their pace, --slow-motion's values and
the bar it is held to."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from batching.call_cost import CONTRACT, profile_path
from bench.harness.costs import Calls

CALL_MS = 100
GPUS = 4
WEB_NODES = 2
ONE_REDIS = "one Redis"
CLUSTER = "3 shards, 3-master cluster"
TOPOLOGIES = [ONE_REDIS, CLUSTER]
CHOSEN = {"both": TOPOLOGIES, "one": [ONE_REDIS], "cluster": [CLUSTER]}
CLUSTER_SHARDS = 3
SLOWED = 20  # --slow-motion: calls and deadlines this many times the production farm's
# A web process holds at most WEB_MAX_IN_FLIGHT requests (default 1,000) on at most
# WEB_WORKER_CONNECTIONS connections (default 2,000): sized for 500 ms deadlines. Requests stay
# SLOWED times longer in slow motion, so both are SLOWED times higher to keep a process's rate.
# Left at 1,000, the in-flight cap refused about a fifth of 700 req/s on both topologies
# (sampling_shed_requests_total{in_flight}). Left at 2,000, 42 curve GPUs' 24 s answers fill
# them: the rest wait in the listen backlog, which counts against their deadline.
# (docs/benchmarks/farm.md: 8.5% 504, batches of 69 items where the planner says 87.)


def slow_motion(factor: float = SLOWED) -> dict[str, float]:
    """--slow-motion's values: the 20,000 req/s farm with calls and deadlines `factor` times
    longer, and so `factor` times fewer requests a second."""
    return {"gpus": 21, "call_ms": 100 * factor, "deadline_ms": 500 * factor,
            "max_in_flight": 1_000 * factor, "connections": 2_000 * factor,
            "rate": 20_000 / factor, "seconds": 60.0, "rounds": 1}  # fmt: skip


SLOW_MOTION = slow_motion()
OK_BAR_PERCENT = 99.9  # --slow-motion's bar: answered 200 at least, and no other answer


@dataclass(frozen=True)
class Shape:
    """The farm's workers and their pace: `gpus` simulated workers, `call_ms` a call,
    `deadline_ms` deadlines, and at most `max_in_flight` requests per web process, on at most
    `connections` connections."""

    gpus: int = GPUS
    call_ms: int = CALL_MS
    deadline_ms: int | None = None
    max_in_flight: int | None = None  # WEB_MAX_IN_FLIGHT (None: the service's default)
    cost: str = CONTRACT  # a cost profile's name or file: calls priced on its curve
    connections: int | None = None  # WEB_WORKER_CONNECTIONS (None: the service's default)

    def web_env(self) -> dict[str, str]:
        """The web processes' settings this shape sets (the service's defaults otherwise)."""
        env = {"WEB_MAX_IN_FLIGHT": self.max_in_flight, "WEB_WORKER_CONNECTIONS": self.connections}
        return {name: str(value) for name, value in env.items() if value is not None}

    @cached_property
    def calls(self) -> Calls:
        return Calls(self.cost, self.call_ms)

    @property
    def client_timeout_s(self) -> float:
        """The client waits past any deadline: an answer it gives up on counts as other."""
        return max(3.0, (self.deadline_ms or 0) / 1000 + 2.0)


def slowed_profile(name_or_path: str, factor: float, work: Path) -> str:
    """A copy of a cost profile whose every time is `factor` times the original's, written in
    `work`: the path the simulated workers read (SIMULATED_COST)."""
    raw: dict[str, Any] = json.loads(profile_path(name_or_path).read_text())
    for table in ("graphs", "eager"):
        raw[table] = {rows: {tokens: ms * factor for tokens, ms in by_tokens.items()}
                      for rows, by_tokens in raw.get(table, {}).items()}  # fmt: skip
    if "prefill_ms_per_token" in raw:
        raw["prefill_ms_per_token"] *= factor
    raw["name"] = f"{raw['name']} x{factor:g}"
    path = work / "slowed-profile.json"
    path.write_text(json.dumps(raw))
    return str(path)
