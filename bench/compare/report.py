"""The comparison's output: markdown tables, the raw rows as JSON, and three PNG plots
(bench.compare)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.harness.report import markdown_table

PER_GPU_RPS = 1000
DEADLINE_MS = 500
COLOURS = {
    "ours": "#1b7f3b",
    "per-request": "#b2182b",
    "celery-batches": "#2166ac",
    "timer": "#e08214",
    "bare view": "#777777",
}


def _ms(value: object) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.0f}"


def _pct(value: object) -> str:
    return "-" if value is None else f"{value:.1%}".replace(".0%", "%")


def _load(row: dict) -> str:
    return "10 req/s" if row["load_percent"] is None else f"{row['load_percent']}%"


def table(rows: list[dict]) -> str:
    header = [
        "N", "load", "offered req/s", "design", "goodput req/s", "of limit", "p50 ms", "p95 ms",
        "p99 ms", "max ms", "504", "503", "other", "mean batch", "GPU busy", "web CPU ms/req",
        "Redis cmds/req",
    ]  # fmt: skip
    cells = [
        [
            r["gpus"], _load(r), f"{r['offered_rps']:,.0f}", r["design"],
            f"{r['goodput_rps']:,.0f}", _pct(r["goodput_share_of_limit"]), _ms(r["p50_ms"]),
            _ms(r["p95_ms"]), _ms(r["p99_ms"]), _ms(r["max_ms"]), _pct(r["share_504"]),
            _pct(r["share_503"]), _pct(r["share_other"]), _batch(r["mean_batch"]),
            _pct(r["gpu_busy"]), f"{r['web_cpu_ms']:.2f}", f"{r['redis_commands']:.1f}",
        ]
        for r in rows
    ]  # fmt: skip
    return markdown_table(header, cells, align="rrrl" + "r" * 13)


def _batch(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def validation_table(rows: list[dict]) -> str:
    header = [
        "N", "load", "measured goodput", "simulated", "diff", "measured p99 ms", "simulated",
        "diff", "measured batch", "simulated",
    ]  # fmt: skip
    cells = []
    for r in rows:
        if r["design"] != "ours" or "sim_goodput_rps" not in r:
            continue
        good_diff = (r["goodput_rps"] - r["sim_goodput_rps"]) / r["sim_goodput_rps"]
        p99_diff = (r["p99_ms"] - r["sim_p99_ms"]) / r["sim_p99_ms"]
        cells.append([
            r["gpus"], _load(r), f"{r['goodput_rps']:,.0f}", f"{r['sim_goodput_rps']:,.0f}",
            f"{good_diff:+.0%}", f"{r['p99_ms']:,.0f}", f"{r['sim_p99_ms']:,.0f}",
            f"{p99_diff:+.0%}", _batch(r["mean_batch"]), f"{r['sim_mean_batch']:.1f}",
        ])  # fmt: skip
    return markdown_table(header, cells, align="r" * len(header))


def _ratio(ours: float, theirs: float | None) -> str:
    if theirs is None:
        return "-"
    return "none served" if theirs == 0 else f"{ours / theirs:.1f}x"


def ratios(rows: list[dict]) -> str:
    """Our goodput over each alternative's at the same offered load."""
    ours = {(r["gpus"], r["offered_rps"]): r["goodput_rps"] for r in rows if r["design"] == "ours"}
    others = sorted({r["design"] for r in rows} - {"ours", "bare view"})
    goodput = {(r["design"], r["gpus"], r["offered_rps"]): r["goodput_rps"] for r in rows}
    cells = []
    seen = []
    for r in rows:
        key = (r["gpus"], r["offered_rps"])
        if r["design"] != "ours" or key in seen:
            continue
        seen.append(key)
        theirs = [_ratio(ours[key], goodput.get((name, *key))) for name in others]
        cells.append([r["gpus"], _load(r), *theirs])
    header = ["N", "load", *(f"ours / {name}" for name in others)]
    return markdown_table(header, cells, align="r" * len(header))


def plots(rows: list[dict], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus_list = sorted({r["gpus"] for r in rows})
    designs = [d for d in COLOURS if any(r["design"] == d for r in rows)]
    written = []
    specs = [
        ("goodput.png", "goodput (correct answers/s)", lambda r: r["goodput_rps"]),
        ("p99.png", "p99 latency (ms), every answer", lambda r: r["p99_ms"]),
        ("batch_fill.png", "batch fill (mean batch / 100)",
         lambda r: None if r["mean_batch"] is None else r["mean_batch"] / 100),
    ]  # fmt: skip
    for name, ylabel, value in specs:
        figure, axes = plt.subplots(1, len(gpus_list), figsize=(6 * len(gpus_list), 4.2))
        axes = [axes] if len(gpus_list) == 1 else list(axes)
        for axis, gpus in zip(axes, gpus_list, strict=True):
            for design in designs:
                points = [
                    (r["offered_rps"], value(r))
                    for r in rows
                    if r["design"] == design and r["gpus"] == gpus and value(r) is not None
                ]
                if points:
                    xs, ys = zip(*sorted(points), strict=True)
                    axis.plot(xs, ys, marker="o", label=design, color=COLOURS[design])
            limit = gpus * PER_GPU_RPS
            if name == "goodput.png":
                top = max(r["offered_rps"] for r in rows if r["gpus"] == gpus)
                axis.plot([0, top], [0, top], ":", color="#999999", label="offered")
                axis.axhline(limit, ls="--", color="black", lw=1, label=f"limit {limit:,} req/s")
            if name == "p99.png":
                axis.axhline(DEADLINE_MS, ls="--", color="black", lw=1, label="500 ms deadline")
                axis.set_yscale("log")
            if name == "batch_fill.png":
                axis.set_ylim(0, 1.05)
            axis.axvline(limit, ls=":", color="#bbbbbb", lw=1)
            axis.set_title(f"N = {gpus} simulated GPU{'s' if gpus > 1 else ''}")
            axis.set_xlabel("offered load (req/s, Poisson)")
            axis.set_ylabel(ylabel)
            axis.grid(alpha=0.3)
            axis.legend(fontsize=8)
        figure.tight_layout()
        figure.savefig(out / name, dpi=110)
        plt.close(figure)
        written.append(name)
    return written


def write_report(
    rows: list[dict], out: Path, *, machine: str, duration_s: float, elapsed_s: float
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r.pop("examples", None)
    (out / "results.json").write_text(
        json.dumps({"machine": machine, "duration_s": duration_s, "rows": rows}, indent=1)
    )
    images = plots(rows, out)
    text = f"""# Benchmark: our batching against the alternatives

Written by `make bench-compare` (`python -m bench compare`) in {elapsed_s / 60:.1f} minutes on
{machine}. Each level offers Poisson arrivals for {duration_s:g} s; every service (gunicorn
with 2 gevent processes, N Celery workers with the simulated sampler at 100 ms per call,
one Redis) and the load generator share the machine's cores. The limit is N x 1,000 req/s
(batches of 100 every 100 ms). Latencies are the client's, from each request's intended send
time, over every answer (a 504 counts at its own latency); "other" is any other answer or
none within 3 s.

## Results

{table(rows)}

## Our goodput over each alternative's

{ratios(rows)}

## The capacity planner's simulation against the measurement (ours)

{validation_table(rows)}

## Plots

{chr(10).join(f"![{name}]({name})" for name in images)}
"""
    (out / "results.md").write_text(text)
    print("\n" + table(rows))
    print("\n" + ratios(rows))
    print("\n" + validation_table(rows))
