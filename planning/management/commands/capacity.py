"""`python manage.py capacity --rps 20000 --deadline-ms 500`: how many GPUs, web nodes and Redis
shards. With several models (`--model chat:2000:500 --model embed:500:200:40`, or `--mix FILE`
of such lines: NAME:RPS:DEADLINE_MS[:CALL_MS]): the GPUs of each model, and the web nodes and
Redis shards of the whole mix.

The answer comes from a discrete-event simulation of the service's own policy
(planning/simulation.py): Poisson arrivals, lazy sealing by free GPUs, deadline drops and
admission, searched upward from the analytic lower bound: the fewest GPUs whose full batches
carry more than the rate, a turn being one call and the measured gap between two calls. Web
nodes follow from the front end's measured CPU per request; Redis shards (SAMPLING_SHARDS, a
master each) from one shard's measured ceiling (planning/shard_ceiling.json), at half of it.

On a GPU's cost curve (`--cost h100-graphs-135m`, or a profile file: batching.call_cost) a call
lasts what its rows' shape costs: `--request-shapes` says the requests' prompt tokens and
`max_tokens` (planning.shapes), and the plan prints its latencies in calls too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from batching.call_cost import CONTRACT, CostProfile, load_profile
from batching.policy import MAX_BATCH_SIZE
from planning import mix, simulation
from planning.costs import MEASURED, MEASURED_SHARD
from planning.shapes import RequestShapes, ShapesError, parse_shapes

# Front-end CPU per /sample request, measured by `make bench-compare` (docs/benchmarks:
# ours at 90% load, N = 1, 2026-11-21) on the 2-core machine that docs/benchmarks' figures
# come from.
MEASURED_WEB_CPU_MS = 0.64
TABLE_RATES = [1_000, 10_000, 20_000, 50_000, 100_000]


@dataclass(frozen=True)
class Options:
    """The command's options, typed once."""

    rps: float
    deadline_ms: float
    batch_ms: float
    max_batch: int
    percentile: float
    web_cpu_ms: float
    path_ms: float
    dispatch_ms: float
    gap_ms: float
    web_node_cores: int
    web_utilisation: float
    redis_shard_rps: float
    seconds: float
    seed: int
    table: bool
    cost: str
    request_shapes: str | None

    @classmethod
    def parse(cls, options: dict[str, Any]) -> Options:
        return cls(**{f.name: options[f.name] for f in fields(cls)})

    def scenario(self, rate: float) -> simulation.Scenario:
        if rate <= 0 or self.deadline_ms <= 0 or self.batch_ms <= 0:
            raise CommandError("--rps, --deadline-ms and --batch-ms must be above 0")
        if not 1 <= self.max_batch <= MAX_BATCH_SIZE:
            raise CommandError(f"--max-batch must be 1 to {MAX_BATCH_SIZE}")
        seconds = self.seconds
        if seconds <= 0:
            # Long enough for a steady state (hundreds of calls per GPU), capped at about a
            # million arrivals per GPU count tried.
            seconds = max(10.0, min(60.0, 1_000_000 / rate))
        cost, shapes = self.curve()
        return simulation.Scenario(
            cost=cost,
            shapes=shapes,
            rate_rps=rate,
            gpus=1,
            batch_ms=self.batch_ms,
            max_batch=self.max_batch,
            deadline_ms=self.deadline_ms,
            duration_s=seconds,
            path_ms=self.path_ms,
            dispatch_ms=self.dispatch_ms,
            gap_ms=self.gap_ms,
            seed=self.seed,
        )

    def curve(self) -> tuple[CostProfile | None, RequestShapes | None]:
        """The cost profile and the requests' shapes (None, None: the contract's calls)."""
        if self.cost == CONTRACT:
            if self.request_shapes:
                raise CommandError("--request-shapes prices calls on a cost curve: give --cost")
            return None, None
        if not self.request_shapes:
            raise CommandError("--cost needs --request-shapes: a call's cost is its rows' shape")
        try:
            return load_profile(self.cost, self.batch_ms), parse_shapes(self.request_shapes)
        except (ValueError, ShapesError) as exc:
            raise CommandError(str(exc)) from None

    def web_nodes(self, rate: float) -> int:
        return simulation.web_nodes(
            rate, self.web_cpu_ms, self.web_node_cores, self.web_utilisation
        )

    def redis_shards(self, rate: float) -> int:
        if self.redis_shard_rps <= 0:
            raise CommandError("--redis-shard-rps must be above 0 (no measured ceiling yet)")
        return simulation.redis_shards(rate, self.redis_shard_rps)

    @property
    def redis_basis(self) -> str:
        basis = (
            f"{simulation.SHARD_UTILISATION:.0%} of {self.redis_shard_rps:,.0f} req/s, "
            "one shard's ceiling"
        )
        if MEASURED_SHARD is not None and self.redis_shard_rps == MEASURED_SHARD.shard_rps:
            basis += f", {MEASURED_SHARD.source}"
        return basis

    @property
    def measured_costs(self) -> bool:
        measured = (MEASURED.path_ms, MEASURED.dispatch_ms, MEASURED.gap_ms)
        return (self.path_ms, self.dispatch_ms, self.gap_ms) == measured

    @property
    def web_basis(self) -> str:
        return (
            f"{self.web_cpu_ms} ms CPU per request on {self.web_node_cores}-core "
            f"nodes at {self.web_utilisation:.0%}"
        )


class Command(BaseCommand):
    help = "The fewest GPUs (and web nodes) that keep a latency percentile within the deadline."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--rps", type=float, help="offered requests/s (one model)")
        parser.add_argument("--deadline-ms", type=float, help="(one model)")
        parser.add_argument(
            "--model",
            action="append",
            default=[],
            metavar="NAME:RPS:DEADLINE_MS[:CALL_MS]",
            help="one model of a mix (repeat the option; CALL_MS defaults to --batch-ms)",
        )
        parser.add_argument("--mix", help="a file of NAME:RPS:DEADLINE_MS[:CALL_MS] lines")
        parser.add_argument("--batch-ms", type=float, default=100.0, help="one call's time")
        parser.add_argument("--max-batch", type=int, default=MAX_BATCH_SIZE)
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
        for name, value, what in (
            ("--path-ms", MEASURED.path_ms, "a call's end to the client's answer"),
            ("--dispatch-ms", MEASURED.dispatch_ms, "a lone request's send to its call"),
            ("--gap-ms", MEASURED.gap_ms, "a worker's time between two calls"),
        ):
            parser.add_argument(
                name, type=float, default=value, help=f"{what} (default {value}, measured)"
            )
        shard_rps = MEASURED_SHARD.shard_rps if MEASURED_SHARD is not None else 0.0
        parser.add_argument(
            "--redis-shard-rps",
            type=float,
            default=shard_rps,
            help=f"requests/s one Redis shard carries at p99 under 5 ms (default "
            f"{shard_rps:,.0f}, measured: docs/benchmarks/redis-cost.md)",
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
        parser.add_argument(
            "--cost",
            default=CONTRACT,
            help="a cost profile: contract (every call --batch-ms, the default), "
            "h100-graphs-135m, or a profile file (python -m bench profile_fit)",
        )
        parser.add_argument(
            "--request-shapes",
            metavar="PROMPT_TOKENS:MAX_TOKENS|FILE",
            help="with --cost: the requests' prompt tokens and max_tokens, each N or LOW-HIGH "
            "(20-199:16), or a file of 'PROMPT_TOKENS MAX_TOKENS' lines",
        )
        parser.add_argument("--table", action="store_true", help=f"also plan {TABLE_RATES}")

    def handle(self, *args: Any, **raw: Any) -> None:
        if raw["model"] or raw["mix"]:
            if raw["rps"] is not None or raw["deadline_ms"] is not None:
                raise CommandError("give --rps and --deadline-ms, or a mix (--model, --mix)")
            self.plan_mix(raw)
            return
        if raw["rps"] is None or raw["deadline_ms"] is None:
            raise CommandError("--rps and --deadline-ms are required (or a mix: --model, --mix)")
        options = Options.parse(raw)
        base = options.scenario(options.rps)
        q = options.percentile
        if not 0 < q <= 100:
            raise CommandError("--percentile must be in (0, 100]")
        full_call_ms = base.full_call_ms
        if full_call_ms + base.path_ms > base.deadline_ms:
            raise CommandError(
                f"one call ({full_call_ms:,.1f} ms) plus the request path ({base.path_ms:g} ms) "
                f"is past the {base.deadline_ms:g} ms deadline: no number of GPUs meets it"
            )
        plan = simulation.fewest_gpus(base, q)
        out = plan.outcome
        write = self.stdout.write
        if base.on_curve:
            assert base.cost is not None
            assert base.shapes is not None
            calls = (f"calls on the {base.cost.name} curve (requests of "
                     f"{base.shapes.spec} tokens), a full one {full_call_ms:,.1f} ms")  # fmt: skip
        else:
            calls = f"calls of {base.batch_ms:g} ms"
        write(
            f"{base.rate_rps:,.0f} req/s, p{q:g} within {base.deadline_ms:g} ms, {calls} "
            f"with up to {base.max_batch} prompts:"
        )
        write(f"  GPUs needed:           {plan.gpus}")
        write(
            f"  analytic lower bound:  {plan.lower_bound}  "
            f"(full batches carry more than {base.rate_rps:,.0f} req/s: "
            f"{base.rate_rps:,.0f} x ({full_call_ms:,.1f} + {base.gap_ms:g}) ms / "
            f"{base.max_batch} = {base.full_batch_gpus:.2f} GPUs busy)"
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
        if base.on_curve:
            write(
                f"  in calls:              mean call {out.mean_call_ms:,.1f} ms; p50 / p99 "
                + " / ".join(_calls(out.percentile_ms(p), out.mean_call_ms) for p in (50, 99))
            )
        write(f"  web nodes:             {options.web_nodes(base.rate_rps)}  ({options.web_basis})")
        write(
            f"  Redis shards:          {options.redis_shards(base.rate_rps)}  "
            f"(SAMPLING_SHARDS, a master each, at {options.redis_basis})"
        )
        write(
            f"  fixed costs:           {base.dispatch_ms:g} ms dispatch, {base.gap_ms:g} ms "
            f"between calls, {base.path_ms:g} ms back to the client"
            + (f"  ({MEASURED.source})" if options.measured_costs else "")
        )
        tried = ", ".join(
            f"{gpus}: p{q:g} {_ms(o.percentile_ms(q))}" for gpus, o in sorted(plan.tried.items())
        )
        write(f"  simulated {base.duration_s:g} s per GPU count ({tried})")
        if options.table:
            write("")
            write(self.table(options))

    def plan_mix(self, raw: dict[str, Any]) -> None:
        """Each model's GPUs, then the web nodes and Redis shards of the whole mix."""
        try:
            loads = mix.read_mix(raw["model"], raw["mix"], raw["batch_ms"])
        except mix.MixError as exc:
            raise CommandError(str(exc)) from None
        q = raw["percentile"]
        if not 0 < q <= 100:
            raise CommandError("--percentile must be in (0, 100]")
        lines = [
            f"| model | req/s | deadline | call | GPUs (p{q:g}) | goodput | batch fill | p99 |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        total_gpus = 0
        for load in loads:
            options = Options.parse({**raw, "rps": load.rps, "deadline_ms": load.deadline_ms,
                                     "batch_ms": load.batch_ms})  # fmt: skip
            base = options.scenario(load.rps)
            if base.batch_ms + base.path_ms > base.deadline_ms:
                raise CommandError(
                    f"{load.name}: one call ({load.batch_ms:g} ms) plus the request path is "
                    f"past its {load.deadline_ms:g} ms deadline"
                )
            plan = simulation.fewest_gpus(base, q)
            out = plan.outcome
            total_gpus += plan.gpus
            lines.append(
                f"| {load.name} | {load.rps:,.0f} | {load.deadline_ms:g} ms | {load.batch_ms:g} ms "
                f"| {plan.gpus} | {out.goodput_rps:,.0f} | {out.mean_batch / base.max_batch:.0%} "
                f"| {_ms(out.percentile_ms(99))} |"
            )
        total_rps = sum(load.rps for load in loads)
        options = Options.parse({**raw, "rps": total_rps, "deadline_ms": loads[0].deadline_ms})
        write = self.stdout.write
        write(f"{len(loads)} models, {total_rps:,.0f} req/s in all:")
        write("")
        write("\n".join(lines))
        write("")
        write(f"GPUs in all:   {total_gpus}  (each model its own: a worker serves one model)")
        write(f"web nodes:     {options.web_nodes(total_rps)}  ({options.web_basis})")
        write(
            f"Redis shards:  {options.redis_shards(total_rps)}  (masters for the whole mix, at "
            f"{options.redis_basis})"
        )

    def table(self, options: Options) -> str:
        q = options.percentile
        lines = [
            f"| req/s | lower bound | GPUs (p{q:g}) | goodput | batch fill | p50 | p99 "
            "| web nodes | Redis shards |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for rate in TABLE_RATES:
            plan = simulation.fewest_gpus(options.scenario(rate), q)
            out = plan.outcome
            lines.append(
                f"| {rate:,} | {plan.lower_bound} | {plan.gpus} | {out.goodput_rps:,.0f} "
                f"| {out.mean_batch / out.scenario.max_batch:.0%} "
                f"| {_ms(out.percentile_ms(50))} | {_ms(out.percentile_ms(99))} "
                f"| {options.web_nodes(rate)} | {options.redis_shards(rate)} |"
            )
        return "\n".join(lines)


def _ms(value: float) -> str:
    return "missed" if math.isinf(value) else f"{value:,.0f} ms"


def _calls(value: float, call_ms: float) -> str:
    return "missed" if math.isinf(value) or not call_ms else f"{value / call_ms:.2f} calls"
