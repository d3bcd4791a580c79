"""Fit a cost profile (batching.call_cost) to a GPU report's `bench sampler` tables.

    python -m bench profile_fit --name my-gpu [--report docs/gpu-report.md] [--out FILE]

It reads the first `bench sampler` run of the report (`--section` picks another by its
heading): the header line that names the CUDA graph buckets and the cache's positions, and
each "N new tokens" table's eager and graph calls by batch size. It writes the profile's JSON
(to stdout without `--out`) and prints the fitted lines as a table on stderr. A report of
your own GPU (`make gpu-report`, docs/gpu-report.md says how) fits a profile of your own;
SIMULATED_COST then names its file.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from batching.call_cost import CostProfile

REPORT = Path(__file__).resolve().parent.parent / "docs" / "gpu-report.md"
_GRAPHS = re.compile(r"CUDA graphs for batches of ([\d, ]+) rows.*?a (\d+)-position cache")
_PROMPTS = re.compile(r"prompts of (\d+) to (\d+) tokens")
_TABLE = re.compile(r"^(\d+) new tokens$")
_MS = re.compile(r"([\d,.]+) ms")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", required=True, help="the profile's name")
    parser.add_argument("--report", type=Path, default=REPORT, help="the GPU report (markdown)")
    parser.add_argument(
        "--section", default="### 3.", help="the heading the tables follow (its start)"
    )
    parser.add_argument("--out", type=Path, help="where to write the profile (default: stdout)")


def section_of(report: str, heading: str) -> list[str]:
    """The report's lines from the first heading that starts with `heading` to the next
    heading of the same level or above."""
    lines = report.splitlines()
    level = len(heading) - len(heading.lstrip("#"))
    for start, line in enumerate(lines):
        if line.startswith(heading):
            end = start + 1
            while end < len(lines):
                mark = len(lines[end]) - len(lines[end].lstrip("#"))
                if 0 < mark <= level and lines[end].startswith("#" * mark + " "):
                    break
                end += 1
            return lines[start:end]
    raise SystemExit(f"no heading starting with {heading!r} in the report")


def _ms(cell: str) -> float:
    found = _MS.search(cell)
    if not found:
        raise ValueError(f"not a time: {cell!r}")
    return float(found.group(1).replace(",", ""))


def fit(lines: list[str], name: str, source: str) -> dict[str, Any]:
    """The profile's JSON from a section of `bench sampler` output."""
    text = "\n".join(lines)
    graphs_line = _GRAPHS.search(text)
    if not graphs_line:
        raise SystemExit("the section names no CUDA graph buckets ('CUDA graphs for batches')")
    buckets = [int(size) for size in graphs_line.group(1).replace(" ", "").split(",")]
    prompts = _PROMPTS.search(text)
    graphs: dict[str, dict[str, float]] = {}
    eager: dict[str, dict[str, float]] = {}
    new_tokens = None
    for line in lines:
        table = _TABLE.match(line.strip())
        if table:
            new_tokens = table.group(1)
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if new_tokens is None or len(cells) < 5 or not cells[0].isdigit():
            continue
        rows = cells[0]
        eager.setdefault(rows, {})[new_tokens] = _ms(cells[1])
        graphs.setdefault(rows, {})[new_tokens] = _ms(cells[4])
    if not graphs:
        raise SystemExit("the section holds no 'N new tokens' tables")
    prompt_mix = f"prompts of {prompts.group(1)} to {prompts.group(2)} tokens" if prompts else ""
    return {
        "name": name,
        "source": f"{source}; {prompt_mix}".strip("; "),
        "graph_buckets": buckets,
        "graph_positions": int(graphs_line.group(2)),
        "graphs": graphs,
        "eager": eager,
    }


def main(args: argparse.Namespace) -> int:
    report = args.report.read_text()
    lines = section_of(report, args.section)
    run = [line for line in report[: report.find(lines[0])].splitlines() if line.startswith("## ")]
    heading = lines[0].lstrip("# ").strip()
    source = f"{args.report.name}, {run[-1][3:] + ', ' if run else ''}section {heading!r}"
    try:
        raw = fit(lines, args.name, source)
        profile = CostProfile.of_json(raw)
    except ValueError as exc:
        raise SystemExit(f"the tables do not make a profile: {exc}") from None
    print("| path | rows (bucket) | fixed ms | ms a step |", file=sys.stderr)
    print("| --- | ---: | ---: | ---: |", file=sys.stderr)
    for path, points in (("graphs", profile.graphs), ("eager", profile.eager)):
        for rows, line in points:
            print(f"| {path} | {rows} | {line.fixed_ms:.1f} | {line.step_ms:.2f} |",
                  file=sys.stderr)  # fmt: skip
    written = json.dumps(raw, indent=2) + "\n"
    if args.out:
        args.out.write_text(written)
    else:
        sys.stdout.write(written)
    return 0
