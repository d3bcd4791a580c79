"""Slow clients against the service, with nginx in front and without: /sample's latency.

    .venv/bin/python -m bench slowloris                 # 3,000 slow connections, 3 rounds
    .venv/bin/python -m bench slowloris --slow 3000 --rounds 1 --seconds 10

A slowloris client opens connections and sends a request's head a line at a time, a line
every 2 s, never finishing it; whenever the server closes one, it opens another. Each held
connection costs the server what its design makes it cost: with gunicorn's gevent worker in
front, a greenlet and one of the process's WEB_WORKER_CONNECTIONS (2,000) until gunicorn drops
the head after its 5 s keep-alive, when the client at once takes the slot again (a slow body,
once the head is in, is not bounded at all; not measured here); with nginx in front
(deploy/nginx/, this machine's nginx), a few hundred bytes in its event loop until
client_header_timeout (10 s).

One simulated GPU (100 ms calls) behind one gunicorn process; the slow connections come from
a process of their own, the measured requests from the harness's load generator (open loop, Poisson)
at RATE req/s. Each round measures, in turns: through nginx without and with the slow
connections, then straight to gunicorn without and with them. Reported per front: /sample's
p50 and p99 over every request (a failure counts at the client's timeout), the share
answered 200, the p99's change from the same front without slow clients, and the most
connections gunicorn held accepted while the slow clients were there.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess

from bench.harness.proxy import Nginx, nginx_binary
from bench.harness.report import markdown_table
from bench.harness.stats import median
from bench.slowloris.fronts import (
    CLIENT_TIMEOUT_S,
    RATE_RPS,
    Front,
    measure_fronts,
    slowloris_stack,
)
from bench.slowloris.slow_clients import hold
from devstack.embedded_redis import EmbeddedRedis

SLOW_CONNECTIONS = 3000


def table(rows: list[dict[str, object]]) -> str:
    """Per front and number of slow connections, the medians of the rounds."""
    lines = []
    for front in dict.fromkeys(str(row["front"]) for row in rows):
        mine = [row for row in rows if row["front"] == front]
        base = median(float(str(row["p99"])) for row in mine if row["slow"] == 0)
        for slow in dict.fromkeys(int(str(row["slow"])) for row in mine):
            runs = [row for row in mine if row["slow"] == slow]

            def of(name: str, runs: list[dict[str, object]] = runs) -> float:
                return median(float(str(row.get(name, 0))) for row in runs)

            lines.append([
                front, f"{slow:,} ({of('held'):,.0f})",
                f"{of('gunicorn connections'):,.0f}" if slow else "", f"{of('sent'):,.0f}",
                f"{of('ok'):.1%}", f"{of('p50'):,.0f}", f"{of('p99'):,.0f}",
                f"{(of('p99') / base - 1) * 100:+.0f}%" if slow else "",
            ])  # fmt: skip
    header = [
        "front", "slow connections (held)", "gunicorn's connections", "requests", "200",
        "p50 ms", "p99 ms", "p99 change",
    ]  # fmt: skip
    return markdown_table(header, lines)


def _nginx_version() -> str:
    binary = nginx_binary()
    if binary is None:
        return "no nginx"
    return subprocess.run([binary, "-v"], capture_output=True, text=True).stderr.strip()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--slow", type=int, default=SLOW_CONNECTIONS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="per measurement")
    parser.add_argument("--rate", type=float, default=RATE_RPS, help="measured req/s")
    # The slow clients' own process (slow_clients.SlowClients starts it).
    parser.add_argument(
        "--hold", nargs=3, metavar=("HOST", "PORT", "COUNT"), help=argparse.SUPPRESS
    )


def main(args: argparse.Namespace) -> None:
    if args.hold:
        host, port, count = args.hold
        asyncio.run(hold(host, int(port), int(count)))
        return
    print(
        f"1 simulated GPU (100 ms calls), 1 gunicorn process; {args.rate:g} req/s for "
        f"{args.seconds:g} s a measurement, client timeout {CLIENT_TIMEOUT_S:g} s; "
        f"{args.slow:,} slow connections; {_nginx_version()}"
    )
    rows: list[dict[str, object]] = []
    server = EmbeddedRedis().start()
    try:
        stack = slowloris_stack(server.url).start(timeout_s=120)
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
