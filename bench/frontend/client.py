"""The front-end benchmark's clients: one request, a closed loop of them on gevent, and
sequential single requests (bench.frontend)."""

from __future__ import annotations

import http.client
import time
import uuid

from gevent.pool import Pool

from bench.harness import loadgen
from workers.samplers.simulated import expected_completion

COMPLETIONS = "/v1/completions"
# The endpoints measured with a prompt; the model left to its default, as clients may.
PROTOCOLS = {"/sample": loadgen.RAW_TEXT, COMPLETIONS: loadgen.completions_protocol()}


def one(
    base_port: int,
    path: str,
    body: bytes | None,
    timeout: float = 30,
    headers: dict[str, str] | None = None,
) -> tuple[int, str, float]:
    connection = http.client.HTTPConnection("127.0.0.1", base_port, timeout=timeout)
    try:
        started = time.perf_counter()
        method = "POST" if body is not None else "GET"
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        data = response.read().decode("utf-8", "replace")
        return response.status, data, time.perf_counter() - started
    except OSError as exc:
        return 0, str(exc), time.perf_counter() - started
    finally:
        connection.close()


def closed_loop(
    port: int,
    path: str,
    requests: int,
    concurrency: int,
    check: bool,
    headers: dict[str, str] | None = None,
    status: int = 200,
) -> float:
    """Send `requests` requests with `concurrency` in flight, each to be answered `status`;
    return wall seconds."""
    pool = Pool(concurrency)
    errors: list[str] = []

    def task(i: int) -> None:
        prompt = f"bench {i} {uuid.uuid4().hex[:8]}"
        protocol = PROTOCOLS.get(path)  # None: a GET of a bare view
        payload = protocol.body(prompt) if protocol else None
        answered, body, _ = one(port, path, payload, headers=headers)
        text = protocol.answer(body.encode()) if protocol and answered == 200 else None
        wrong = check and text is not None and text != expected_completion(prompt)
        if answered != status or wrong:
            errors.append(f"{answered} {body[:80]}")

    started = time.perf_counter()
    pool.map(task, range(requests))
    if errors:
        raise SystemExit(f"{len(errors)} bad answers on {path}, e.g. {errors[:3]}")
    return time.perf_counter() - started


def single_latencies_ms(port: int, count: int) -> list[float]:
    latencies = []
    for i in range(count):
        prompt = f"single {i} {uuid.uuid4().hex[:6]}"
        status, body, seconds = one(port, "/sample", prompt.encode())
        assert (status, body) == (200, expected_completion(prompt)), (status, body)
        latencies.append(seconds * 1000)
    return latencies
