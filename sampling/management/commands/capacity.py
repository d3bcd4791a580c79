"""`python manage.py capacity --rps 20000 --deadline-ms 500`: how many GPUs, and web nodes.

The answer comes from a discrete-event simulation of the service's own policy
(sampling/simulation.py): Poisson arrivals, lazy sealing by free GPUs, deadline drops and
admission, searched upward from the analytic lower bound ceil(rps x batch time / max batch).
"""

from __future__ import annotations

import math

from django.core.management.base import BaseCommand, CommandError, CommandParser

from sampling import simulation

# Front-end CPU per /sample request, measured by `make bench-compare` (docs/benchmarks:
# ours at 90% load, N = 1) on the 2-core machine that README's figures come from.
MEASURED_WEB_CPU_MS = 0.9
TABLE_RATES = [1_000, 5_000, 10_000, 20_000, 50_000]


class Command(BaseCommand):
    help = "The fewest GPUs (and web nodes) that keep a latency percentile within the deadline."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--rps", type=float, required=True, help="offered requests/s")
        parser.add_argument("--deadline-ms", type=float, required=True)
        parser.add_argument("--batch-ms", type=float, default=100.0, help="one call's time")
        parser.add_argument("--max-batch", type=int, default=100)
        parser.add_argument(
            "--percentile",
            type=float,
            default=99.0,
            help="this share of requests must be answered within the deadline (default 99)",
        )
        parser.add_argument(
            "--web-cpu-ms",
            type=float,
            default=MEASURED_WEB_CPU_MS,
            help=f"front-end CPU ms per request (default {MEASURED_WEB_CPU_MS}, measured)",
        )
        parser.add_argument("--web-node-cores", type=int, default=16)
        parser.add_argument(
            "--web-utilisation",
            type=float,
            default=0.6,
            help="the share of a web node's cores to plan for (default 0.6: room for bursts)",
        )
        parser.add_argument(
            "--seconds", type=float, default=0.0, help="simulated seconds (default: automatic)"
        )
        parser.add_argument("--seed", type=int, default=1)
        parser.add_argument("--table", action="store_true", help=f"also plan {TABLE_RATES}")

    def handle(self, *args: object, **options: object) -> None:
        try:
            base = self._scenario(options, float(options["rps"]))  # type: ignore[arg-type]
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        q = float(options["percentile"])  # type: ignore[arg-type]
        if not 0 < q <= 100:
            raise CommandError("--percentile must be in (0, 100]")
        if base.batch_ms + base.path_ms > base.deadline_ms:
            raise CommandError(
                f"one call ({base.batch_ms:g} ms) plus the request path ({base.path_ms:g} ms) "
                f"is past the {base.deadline_ms:g} ms deadline: no number of GPUs meets it"
            )
        plan = simulation.fewest_gpus(base, q)
        out = plan.outcome
        nodes = self._web_nodes(options, base.rate_rps)
        write = self.stdout.write
        write(
            f"{base.rate_rps:,.0f} req/s, p{q:g} within {base.deadline_ms:g} ms, calls of "
            f"{base.batch_ms:g} ms with up to {base.max_batch} prompts:"
        )
        write(f"  GPUs needed:           {plan.gpus}")
        write(
            f"  analytic lower bound:  {plan.lower_bound}  "
            f"(ceil({base.rate_rps:,.0f} x {base.batch_ms / 1000:g} s / {base.max_batch}))"
        )
        write(
            f"  predicted goodput:     {out.goodput_rps:,.0f} req/s "
            f"({out.ok_share:.2%} answered in time)"
        )
        write(
            f"  batch fill:            {out.mean_batch / base.max_batch:.0%} "
            f"(mean batch {out.mean_batch:.1f}); GPUs busy {out.busy_share:.0%}"
        )
        write(
            "  latency p50/p95/p99:   "
            + " / ".join(_ms(out.percentile_ms(p)) for p in (50, 95, 99))
        )
        write(f"  web nodes:             {nodes}  ({self._web_basis(options)})")
        tried = ", ".join(
            f"{gpus}: p{q:g} {_ms(o.percentile_ms(q))}" for gpus, o in sorted(plan.tried.items())
        )
        write(f"  simulated {base.duration_s:g} s per GPU count ({tried})")
        if options["table"]:
            write("")
            write(self.table(options, q))

    def table(self, options: dict[str, object], q: float) -> str:
        lines = [
            f"| req/s | lower bound | GPUs (p{q:g}) | goodput | batch fill | p50 | p99 "
            "| web nodes |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for rate in TABLE_RATES:
            plan = simulation.fewest_gpus(self._scenario(options, rate), q)
            out = plan.outcome
            lines.append(
                f"| {rate:,} | {plan.lower_bound} | {plan.gpus} | {out.goodput_rps:,.0f} "
                f"| {out.mean_batch / out.scenario.max_batch:.0%} "
                f"| {_ms(out.percentile_ms(50))} | {_ms(out.percentile_ms(99))} "
                f"| {self._web_nodes(options, rate)} |"
            )
        return "\n".join(lines)

    def _scenario(self, options: dict[str, object], rate: float) -> simulation.Scenario:
        deadline = float(options["deadline_ms"])  # type: ignore[arg-type]
        batch_ms = float(options["batch_ms"])  # type: ignore[arg-type]
        max_batch = int(options["max_batch"])  # type: ignore[call-overload]
        if rate <= 0 or deadline <= 0 or batch_ms <= 0:
            raise ValueError("--rps, --deadline-ms and --batch-ms must be above 0")
        if not 1 <= max_batch <= 100:
            raise ValueError("--max-batch must be 1 to 100")
        seconds = float(options["seconds"])  # type: ignore[arg-type]
        if seconds <= 0:
            # Long enough for a steady state (hundreds of calls per GPU), capped at about a
            # million arrivals per GPU count tried.
            seconds = max(10.0, min(60.0, 1_000_000 / rate))
        return simulation.Scenario(
            rate_rps=rate,
            gpus=1,
            batch_ms=batch_ms,
            max_batch=max_batch,
            deadline_ms=deadline,
            duration_s=seconds,
            seed=int(options["seed"]),  # type: ignore[call-overload]
        )

    def _web_nodes(self, options: dict[str, object], rate: float) -> int:
        return simulation.web_nodes(
            rate,
            float(options["web_cpu_ms"]),  # type: ignore[arg-type]
            int(options["web_node_cores"]),  # type: ignore[call-overload]
            float(options["web_utilisation"]),  # type: ignore[arg-type]
        )

    def _web_basis(self, options: dict[str, object]) -> str:
        return (
            f"{options['web_cpu_ms']} ms CPU per request on {options['web_node_cores']}-core "
            f"nodes at {float(options['web_utilisation']):.0%}"  # type: ignore[arg-type]
        )


def _ms(value: float) -> str:
    return "missed" if math.isinf(value) else f"{value:,.0f} ms"
