"""An open-loop HTTP load generator: Poisson arrivals at a fixed rate, whatever the server does.

A closed loop (N connections, each waiting for its answer before the next request) slows
down with the server and hides its latency under overload. Here each request has an
intended send time drawn from a Poisson process, and its latency is measured from that
intended time, so a late send (the client itself behind) counts against the result rather
than vanishing (no coordinated omission). Every request gets a connection: an idle
keep-alive one, or a new one.

Each request's prompt is distinct, and each 200's body is checked against `expected(prompt)`.
Django-free and service-free: a host, a port, a path and numbers in; Results out.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from batching.outcomes import RequestOutcome
from bench.harness.connections import Connections, exchange
from bench.harness.stats import percentile

# A request's outcome as the client sees it: the service's own (batching.outcomes) for the
# answers it gives (200: ok, 504: timeout, 503: rejected), and two the client adds.
WRONG = "wrong"  # a 200 with someone else's (or no) completion: must never happen
OTHER = "other"  # any other status, a connection error, or no answer within the client's wait
STATUS_OUTCOMES = {
    200: RequestOutcome.OK,
    504: RequestOutcome.TIMEOUT,
    503: RequestOutcome.REJECTED,
}


def _raw_answer(body: bytes) -> str:
    return body.decode("utf-8", "replace")


@dataclass(frozen=True)
class Protocol:
    """How a prompt goes into a request body and a completion comes out of an answer."""

    content_type: str = "text/plain"
    body: Callable[[str], bytes] = str.encode
    answer: Callable[[bytes], str] = _raw_answer


RAW_TEXT = Protocol()  # POST /sample


def completions_protocol(model: str | None = None, max_tokens: int | None = None) -> Protocol:
    """POST /v1/completions with one prompt, as the openai client sends it; the answer is
    the first choice's text."""
    settings = {"model": model, "max_tokens": max_tokens}
    fields = {name: value for name, value in settings.items() if value is not None}

    def body(prompt: str) -> bytes:
        return json.dumps({**fields, "prompt": prompt}).encode()

    def answer(raw: bytes) -> str:
        return str(json.loads(raw)["choices"][0]["text"])

    return Protocol("application/json", body, answer)


@dataclass
class Results:
    rate_rps: float
    duration_s: float
    latencies_ms: list[float] = field(default_factory=list)  # one per request, any outcome
    outcomes: list[str] = field(default_factory=list)
    send_lag_ms: list[float] = field(default_factory=list)  # actual minus intended send time
    intended_s: list[float] = field(default_factory=list)  # intended send, from the start
    wall_s: float = 0.0  # first intended send to last answer
    client_cpu_s: float = 0.0
    examples: dict[str, str] = field(default_factory=dict)  # one body per outcome

    @property
    def sent(self) -> int:
        return len(self.outcomes)

    def count(self, outcome: str) -> int:
        return self.outcomes.count(outcome)

    @property
    def goodput_rps(self) -> float:
        return self.count(RequestOutcome.OK) / self.duration_s

    def share(self, outcome: str) -> float:
        return self.count(outcome) / self.sent if self.sent else 0.0

    def percentile_ms(self, q: float, outcome: str | None = None) -> float:
        """Latency percentile over every request (failures included at their own latency)."""
        values = [
            latency
            for latency, got in zip(self.latencies_ms, self.outcomes, strict=True)
            if outcome is None or got == outcome
        ]
        return percentile(values, q)


def _none(index: int) -> dict[str, str]:
    return {}


def poisson_schedule(rate_rps: float, duration_s: float, seed: int) -> list[float]:
    """Intended send offsets (s) of a Poisson process of `rate_rps` over `duration_s`."""
    rng = random.Random(seed)
    offsets, at = [], rng.expovariate(rate_rps)
    while at < duration_s:
        offsets.append(at)
        at += rng.expovariate(rate_rps)
    return offsets


async def _run(
    host: str,
    ports: list[int],
    path: str,
    rate_rps: float,
    duration_s: float,
    prompt: Callable[[int], str],
    expected: Callable[[str], str] | None,
    client_timeout_s: float,
    seed: int,
    post: bool,
    protocol: Protocol,
    constant: bool,
    headers: Callable[[int], dict[str, str]] | None,
    stamp: bool,
) -> Results:
    if constant:
        offsets = [index / rate_rps for index in range(round(rate_rps * duration_s))]
    else:
        offsets = poisson_schedule(rate_rps, duration_s, seed)
    results = Results(rate_rps, duration_s)
    results.latencies_ms = [0.0] * len(offsets)
    results.outcomes = [OTHER] * len(offsets)
    results.send_lag_ms = [0.0] * len(offsets)
    results.intended_s = list(offsets)
    # Request i goes to ports[i % len(ports)]: the load split evenly over several servers
    # (web nodes), as a round-robin balancer would.
    pools = [Connections(host, port) for port in ports]
    loop = asyncio.get_running_loop()

    async def one(index: int, intended: float) -> None:
        text = prompt(index)
        body = protocol.body(text)
        extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or _none)(index).items())
        if stamp:  # when it reached "the node": as nginx's `t=${msec}`, at the intended time
            extra += f"X-Request-Start: t={time.time() - (loop.time() - intended):.6f}\r\n"
        if post:
            request = (
                f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n"
                f"Content-Type: {protocol.content_type}\r\n{extra}\r\n"
            ).encode() + body
        else:
            request = f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode()
        results.send_lag_ms[index] = (loop.time() - intended) * 1000
        try:
            status, answer = await asyncio.wait_for(
                exchange(pools[index % len(pools)], request), timeout=client_timeout_s
            )
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
            outcome, answer = OTHER, f"{type(exc).__name__}: {exc}".encode()
        else:
            outcome = STATUS_OUTCOMES.get(status, OTHER)
            checked = outcome == RequestOutcome.OK and expected is not None
            if checked and protocol.answer(answer) != expected(text):  # type: ignore[misc]
                outcome = WRONG
            answer = f"{status} ".encode() + answer
        results.latencies_ms[index] = (loop.time() - intended) * 1000
        results.outcomes[index] = outcome
        results.examples.setdefault(outcome, answer.decode("utf-8", "replace")[:200])

    cpu_before = time.process_time()
    start = loop.time() + 0.05
    tasks = []
    for index, offset in enumerate(offsets):
        intended = start + offset
        delay = intended - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(index, intended)))
    await asyncio.gather(*tasks)
    results.wall_s = loop.time() - start
    for connections in pools:
        connections.close()
    results.client_cpu_s = time.process_time() - cpu_before
    return results


def run(
    host: str,
    port: int | Sequence[int],
    path: str,
    rate_rps: float,
    duration_s: float,
    prompt: Callable[[int], str],
    expected: Callable[[str], str] | None,
    *,
    client_timeout_s: float = 3.0,
    seed: int = 1,
    post: bool = True,
    protocol: Protocol | None = None,
    constant: bool = False,
    headers: Callable[[int], dict[str, str]] | None = None,
    stamp: bool = False,
) -> Results:
    """Offer `rate_rps` Poisson requests (evenly spaced when `constant`) for `duration_s` and
    wait for every answer (or the client's timeout). GET without a body when `post` is false
    (a bare view). Several ports: the requests go to each in turn. `protocol`: how a prompt
    is sent and a completion read back (by default /sample's raw text; `expected` None: any
    text, as a model writes); `headers(i)`: request
    i's own headers (an API key, say). `stamp`: each request carries `X-Request-Start` with
    its intended send time, as a proxy in front of the node would set it at arrival."""
    ports = [port] if isinstance(port, int) else list(port)
    work = _run(
        host, ports, path, rate_rps, duration_s, prompt, expected, client_timeout_s, seed, post,
        protocol or RAW_TEXT, constant, headers, stamp,
    )  # fmt: skip
    return asyncio.run(work)
