"""Slow clients against the service, with nginx in front and without: /sample's latency.

    .venv/bin/python -m bench.slowloris                 # 3,000 slow connections, 3 rounds
    .venv/bin/python -m bench.slowloris --slow 3000 --rounds 1 --seconds 10

A slowloris client opens connections and sends a request's head a line at a time, a line
every 2 s, never finishing it; whenever the server closes one, it opens another. Each held
connection costs the server what its design makes it cost: with gunicorn's gevent worker in
front, a greenlet and one of the process's WEB_WORKER_CONNECTIONS (2,000) until gunicorn drops
the head after its 5 s keep-alive, when the client at once takes the slot again (a slow body,
once the head is in, is not bounded at all; not measured here); with nginx in front
(deploy/nginx/, this machine's nginx), a few hundred bytes in its event loop until
client_header_timeout (10 s).

One simulated GPU (100 ms calls) behind one gunicorn process; the slow connections come from
a process of their own, the measured requests from `bench/loadgen.py` (open loop, Poisson)
at RATE req/s. Each round measures, in turns: through nginx without and with the slow
connections, then straight to gunicorn without and with them. Reported per front: /sample's
p50 and p99 over every request (a failure counts at the client's timeout), the share
answered 200, the p99's change from the same front without slow clients, and the most
connections gunicorn held accepted while the slow clients were there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from batching.outcomes import RequestOutcome
from bench import loadgen
from bench.overload import simulated_env
from bench.procstat import accepted_connections
from bench.proxy import Nginx, nginx_binary
from inference_site.lib.embedded_redis import EmbeddedRedis
from inference_site.lib.stack import ROOT, Stack
from workers.samplers.simulated import expected_completion

SLOW_CONNECTIONS = 3000
RATE_RPS = 100
CLIENT_TIMEOUT_S = 3.0
LINE_EVERY_S = 2.0
HEAD = b"POST /sample HTTP/1.1\r\nHost: localhost\r\nContent-Type: text/plain\r\n"


# --- the slow client, run as `python -m bench.slowloris --hold HOST PORT COUNT` ------------


async def _hold(host: str, port: int, count: int) -> None:
    """Keep `count` unfinished requests open; print how many are open once a second."""
    state = {"open": 0, "reopened": 0}

    async def one(index: int) -> None:
        await asyncio.sleep(index / 1500)  # 1,500 new connections a second: no SYN storm
        while True:
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except OSError:
                await asyncio.sleep(0.5)
                continue
            state["open"] += 1
            try:
                writer.write(HEAD)
                while True:
                    try:
                        # Anything read (a 408, say) or the end: the server let go of it.
                        await asyncio.wait_for(
                            reader.read(4096), LINE_EVERY_S * random.uniform(0.8, 1.2)
                        )
                        break
                    except TimeoutError:
                        writer.write(b"X-Slow: %d\r\n" % index)
                        await writer.drain()
            except OSError:
                pass
            finally:
                state["open"] -= 1
                state["reopened"] += 1
                writer.close()

    tasks = [asyncio.create_task(one(index)) for index in range(count)]
    while True:
        print(f"open {state['open']} reopened {state['reopened']}", flush=True)
        await asyncio.sleep(1.0)
    del tasks  # pragma: no cover - runs until killed


@dataclass
class SlowClients:
    """The slow connections, from a child process, while the `with` block runs."""

    host: str
    port: int
    count: int
    opened: int = 0  # the most connections seen open at once

    @contextlib.contextmanager
    def held(self, settle_s: float = 3.0) -> Iterator[SlowClients]:
        process = subprocess.Popen(
            [sys.executable, "-m", "bench.slowloris", "--hold", self.host, str(self.port),
             str(self.count)],
            stdout=subprocess.PIPE, text=True, cwd=ROOT,
        )  # fmt: skip
        assert process.stdout is not None
        stdout = process.stdout

        def read() -> None:
            for line in stdout:
                self.opened = max(self.opened, int(line.split()[1]))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            time.sleep(self.count / 1500 + settle_s)  # all of them opened, then held a while
            yield self
        finally:
            process.kill()
            process.wait()


# --- the measurement -----------------------------------------------------------------------


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


def simulated_stack(redis_url: str) -> Stack:
    queue = f"bench-slowloris-{uuid.uuid4().hex[:6]}"
    env = simulated_env(redis_url, queue)
    # gunicorn's own defaults for one process: 2,000 connections.
    return Stack(env=env, gpus=[0], web_processes=1, own_database=True,
                 log_dir=Path(tempfile.mkdtemp(prefix=f"{queue}-")))  # fmt: skip


def table(rows: list[dict[str, object]]) -> str:
    lines = [
        "| front | slow connections (held) | gunicorn's connections | requests | 200 | p50 ms "
        "| p99 ms | p99 change |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for front in dict.fromkeys(str(row["front"]) for row in rows):
        mine = [row for row in rows if row["front"] == front]
        for slow in dict.fromkeys(int(str(row["slow"])) for row in mine):
            runs = [row for row in mine if row["slow"] == slow]
            p99 = statistics.median(float(str(row["p99"])) for row in runs)
            base = statistics.median(float(str(row["p99"])) for row in mine if row["slow"] == 0)
            held = statistics.median(int(str(row.get("held", 0))) for row in runs)
            accepted = statistics.median(
                int(str(row.get("gunicorn connections", 0))) for row in runs
            )
            accepted_text = f"{accepted:,.0f}" if slow else ""
            ok = statistics.median(float(str(row["ok"])) for row in runs)
            p50 = statistics.median(float(str(row["p50"])) for row in runs)
            sent = statistics.median(int(str(row["sent"])) for row in runs)
            change = f"{(p99 / base - 1) * 100:+.0f}%" if slow else ""
            lines.append(
                f"| {front} | {slow:,} ({held:,.0f}) | {accepted_text} | {sent:,.0f} | {ok:.1%} "
                f"| {p50:,.0f} | {p99:,.0f} | {change} |"
            )
    return "\n".join(lines)


def _nginx_version() -> str:
    binary = nginx_binary()
    if binary is None:
        return "no nginx"
    return subprocess.run([binary, "-v"], capture_output=True, text=True).stderr.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slow", type=int, default=SLOW_CONNECTIONS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="per measurement")
    parser.add_argument("--rate", type=float, default=RATE_RPS, help="measured req/s")
    parser.add_argument(
        "--hold", nargs=3, metavar=("HOST", "PORT", "COUNT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.hold:
        host, port, count = args.hold
        asyncio.run(_hold(host, int(port), int(count)))
        return
    print(
        f"1 simulated GPU (100 ms calls), 1 gunicorn process; {args.rate:g} req/s for "
        f"{args.seconds:g} s a measurement, client timeout {CLIENT_TIMEOUT_S:g} s; "
        f"{args.slow:,} slow connections; {_nginx_version()}"
    )
    rows: list[dict[str, object]] = []
    server = EmbeddedRedis().start()
    try:
        stack = simulated_stack(server.url).start(timeout_s=120)
        try:
            with Nginx(stack.port) as nginx:
                fronts = [Front("nginx", nginx.port), Front("gunicorn", stack.port)]
                for round_number in range(args.rounds):
                    print(f"round {round_number + 1}", flush=True)
                    for row in measure_fronts(
                        fronts, args.slow, args.seconds, stack.port, args.rate
                    ):
                        print(f"  {row}", flush=True)
                        rows.append(row)
        finally:
            stack.stop()
    finally:
        server.stop()
    print(f"\nMedians of {args.rounds} round(s):\n")
    print(table(rows))


if __name__ == "__main__":
    main()
