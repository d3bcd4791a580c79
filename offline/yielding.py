"""The feeder shares a web process with requests (offline.feeder): under gevent its run is a
greenlet, and a greenlet that does not yield holds every request of its process. A run's
answers and lines took tens of milliseconds at once, and the requests' p99 with them
(`bench backfill`), so the feeder yields between steps of a few lines."""

from __future__ import annotations

import time


def let_requests_run() -> None:
    """Yield to the process's other greenlets (`time.sleep` is gevent's where it patched it;
    in a plain thread, a no-op)."""
    time.sleep(0)  # duration: none, a yield
