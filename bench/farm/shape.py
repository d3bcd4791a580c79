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
# A web process holds at most WEB_MAX_IN_FLIGHT requests (default 1,000): sized for 500 ms
# deadlines, it caps a process at 2,000 req/s. Requests stay SLOWED times longer in slow
# motion, so the cap is SLOWED times higher to keep that rate: left at 1,000, it refused
# about a fifth of 700 req/s on both topologies (sampling_shed_requests_total{in_flight}).
SLOW_MOTION = {"gpus": 21, "call_ms": 100 * SLOWED, "deadline_ms": 500 * SLOWED,
               "max_in_flight": 1_000 * SLOWED, "rate": 20_000 / SLOWED, "seconds": 60.0,
               "rounds": 1}  # fmt: skip
OK_BAR_PERCENT = 99.9  # --slow-motion's bar: answered 200 at least, and no other answer


@dataclass(frozen=True)
class Shape:
    """The farm's workers and their pace: `gpus` simulated workers, `call_ms` a call,
    `deadline_ms` deadlines, and at most `max_in_flight` requests per web process."""

    gpus: int = GPUS
    call_ms: int = CALL_MS
    deadline_ms: int | None = None
    max_in_flight: int | None = None  # WEB_MAX_IN_FLIGHT (None: the service's default)

    @property
    def client_timeout_s(self) -> float:
        """The client waits past any deadline: an answer it gives up on counts as other."""
        return max(3.0, (self.deadline_ms or 0) / 1000 + 2.0)
