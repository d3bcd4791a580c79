"""/sample measured through each front (nginx, gunicorn), without and with slow clients held
against it: a slow client sends a request's head a line every 2 s and never finishes it."""

from __future__ import annotations

import contextlib
import random
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from batching.outcomes import RequestOutcome
from bench.harness import loadgen
from bench.harness.procstat import accepted_connections
from tests.support.slow_clients import SlowClients
from workers.samplers.simulated import expected_completion

RATE_RPS = 100
CLIENT_TIMEOUT_S = 3.0


def measure(port: int, seconds: float, rate_rps: float = RATE_RPS) -> dict[str, float]:
    tag = uuid.uuid4().hex[:6]
    results = loadgen.run(
        "127.0.0.1", port, "/sample", rate_rps, seconds,
        lambda index: f"slowloris {tag} {index}", expected_completion,
        client_timeout_s=CLIENT_TIMEOUT_S, seed=random.randrange(1 << 30),
    )  # fmt: skip
    return {
        "sent": results.sent,
        "ok": results.share(RequestOutcome.OK),
        "unanswered": results.count(loadgen.OTHER),  # no 200, 503 or 504 in the client's wait
        "wrong": results.count(loadgen.WRONG),
        "p50": results.percentile_ms(50),
        "p99": results.percentile_ms(99),
    }


@dataclass
class Front:
    name: str
    port: int


@contextlib.contextmanager
def most_accepted(port: int, every_s: float = 0.5) -> Iterator[list[int]]:
    """The most connections the server on `port` held accepted at once while the block ran."""
    most, done = [0], threading.Event()

    def sample() -> None:
        while not done.wait(every_s):
            most[0] = max(most[0], accepted_connections(port))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield most
    finally:
        done.set()
        sampler.join()


def measure_fronts(
    fronts: list[Front], slow: int, seconds: float, gunicorn_port: int,
    rate_rps: float = RATE_RPS,
) -> list[dict[str, object]]:  # fmt: skip
    """Each front without, then with, `slow` slow connections held against it; with them, the
    most connections gunicorn held accepted (of its WEB_WORKER_CONNECTIONS)."""
    rows: list[dict[str, object]] = []
    for front in fronts:
        rows.append({"front": front.name, "slow": 0, **measure(front.port, seconds, rate_rps)})
        clients = SlowClients("127.0.0.1", front.port, slow)
        with clients.held(), most_accepted(gunicorn_port) as gunicorn_held:
            figures = measure(front.port, seconds, rate_rps)
        rows.append({"front": front.name, "slow": slow, "held": clients.opened,
                     "gunicorn connections": gunicorn_held[0], **figures})  # fmt: skip
        time.sleep(2.0)  # the slow connections' sockets closed before the next front
    return rows
