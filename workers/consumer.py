"""The Celery worker's consumer, reconnecting to the broker within a second of its return.

Celery's consumer retries a lost broker connection with kombu's default intervals: 2 s, then
4, 6, 8... up to 30 s between tries. After a 30-second Redis outage a worker could sleep ten
seconds more before it took tasks again, while the web processes were serving
(docs/reliability.md: full service within 2 s of Redis' return). Here the tries are 0.25 s
apart at first and never more than 1 s apart: a refused connection costs a Redis that is
down nothing, and a worker that is not consuming costs its GPU's whole share.
"""

from __future__ import annotations

import functools
from typing import Any

from celery.worker.consumer import Consumer

# kombu's stubs say int; retry_over_time sleeps any number of seconds.
RETRY_INTERVALS: dict[str, Any] = {
    "interval_start": 0.25,
    "interval_step": 0.25,
    "interval_max": 1.0,
}


class PromptReconnectConsumer(Consumer):
    def connection_for_read(self, heartbeat: float | None = None) -> Any:
        connection = self.app.connection_for_read(heartbeat=heartbeat)
        connection.ensure_connection = functools.partial(  # type: ignore[method-assign]
            connection.ensure_connection, **RETRY_INTERVALS
        )
        return self.ensure_connected(connection)
