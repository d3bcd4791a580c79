"""Every Redis key of a queue, built in one place.

All keys of a queue share the hash tag `{queue}`, so a queue's scripts stay on one slot of a
Redis cluster. Nothing else in the project spells a `sampling:{queue}:...` key.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class QueueKeys:
    """The keys of one queue; each built once per instance (the request path reads some on
    every request)."""

    queue: str

    @cached_property
    def tag(self) -> str:
        return f"sampling:{{{self.queue}}}"

    # --- the aggregator (batching.aggregator) --------------------------------------------
    @cached_property
    def open_batch(self) -> str:
        """The id of the batch new requests join (absent: the next request opens one)."""
        return f"{self.tag}:open"

    @cached_property
    def unsealed(self) -> str:
        """A zset of batches not sealed yet, scored by their opening time (ms)."""
        return f"{self.tag}:unsealed"

    @cached_property
    def handover_due(self) -> str:
        """A zset of unsealed batches whose task may be lost, scored by the time (ms) from which
        a request hands the batch over (sends its task again) if it is still unsealed: a batch
        whose task is not known to be sent yet (member: its id), and a batch a worker received
        before its GPU was free (member: id + HELD_SUFFIX), in case that worker dies first."""
        return f"{self.tag}:handover-due"

    @cached_property
    def batch_prefix(self) -> str:
        return f"{self.tag}:batch:"

    def batch(self, batch_id: str) -> str:
        """The list of a batch's items, one "deadline_ms prompt" string each."""
        return self.batch_prefix + batch_id

    @cached_property
    def live_workers(self) -> str:
        """A zset of worker names scored by their last heartbeat (Redis time, ms)."""
        return f"{self.tag}:workers"

    @cached_property
    def turn_ms(self) -> str:
        """The workers' running estimate of one batch's turn on a GPU, for admission."""
        return f"{self.tag}:sampler_ms"

    @cached_property
    def batch_log(self) -> str:
        """The last batch records (JSON), newest first."""
        return f"{self.tag}:batches"

    # --- workers, as the operators see them -----------------------------------------------
    def worker_info(self, worker: str) -> str:
        """A worker's row of the stats page (JSON), written with its heartbeat."""
        return f"{self.tag}:worker:{worker}"

    @cached_property
    def known_workers(self) -> str:
        """A zset of worker names scored by their last heartbeat (epoch seconds)."""
        return f"{self.tag}:known-workers"

    def worker_metrics(self, worker: str) -> str:
        """A worker's Prometheus exposition, published with its heartbeat."""
        return f"{self.tag}:metrics:{worker}"

    # --- policy and statistics -------------------------------------------------------------
    @cached_property
    def policy(self) -> str:
        return f"{self.tag}:policy"

    def stats_bucket(self, granularity_s: int, start_s: int) -> str:
        return f"{self.tag}:stats:{granularity_s}:{start_s}"

    @cached_property
    def persisted_minute(self) -> str:
        """The last minute of statistics written to the database."""
        return f"{self.tag}:stats:persisted-minute"

    @cached_property
    def housekeeping_lock(self) -> str:
        return f"{self.tag}:housekeeping"
