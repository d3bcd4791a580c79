"""What a sampler call costs on the GPU, by its shape: the simulator spends it, the worker
predicts with it, the planner plans with it.

A profile is `contract` (the problem's own: every call lasts the same, whatever its rows and
tokens) or a curve fitted to a GPU report's tables (`python -m bench profile_fit`): for each
measured row count, a straight line in the steps decoded, the call's time at 16 and 32 new
tokens say. A call's rows round up to the CUDA graph bucket they run in (the report measures
1, 10, 50 and 100 rows, which run in buckets of 1, 16, 64 and 100), and a bucket between two
measured ones is interpolated. A call whose prompt and new tokens do not fit the graphs'
positions falls back to eager `generate`, for all its rows, on the eager curve.

The report's tables measure one mix of prompt lengths (their header says which). Within the
graphs' positions, a call's time here does not grow with its prompt unless the profile sets
`prefill_ms_per_token` (per padded prompt token of each of the bucket's rows).

Profiles ship in batching/cost_profiles/ (by name), or a path names a JSON file of one.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

PROFILES_DIR = Path(__file__).with_name("cost_profiles")
CONTRACT = "contract"


@dataclass(frozen=True)
class Shape:
    """A call's shape: its rows, its longest prompt (in tokens: every row is padded to it),
    the steps it decodes (its longest row's new tokens), and the most new tokens any row may
    ask (what decides whether the call fits the graphs; 0: `steps`)."""

    rows: int
    prompt_tokens: int
    steps: int
    max_new_tokens: int = 0


@dataclass(frozen=True)
class Line:
    """A call's time in a straight line of its steps: `fixed_ms` + `step_ms` x steps."""

    fixed_ms: float
    step_ms: float

    def at(self, steps: int) -> float:
        return self.fixed_ms + self.step_ms * steps

    @staticmethod
    def fit(points: dict[int, float]) -> Line:
        """The least-squares line through (steps, ms) points; with one point, or a fit that
        would start below 0 ms, a line through the origin."""
        xs, ys = list(points), list(points.values())
        if len(xs) > 1:
            mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
            spread = sum((x - mean_x) ** 2 for x in xs)
            slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
            fixed = mean_y - slope * mean_x
            if fixed >= 0 and slope >= 0:
                return Line(fixed, slope)
        return Line(0.0, sum(ys) / sum(xs))


def _between(points: list[tuple[int, Line]], rows: int) -> Line:
    """The line at `rows`, linear between the two measured row counts around it (the
    nearest's, outside them)."""
    sizes = [size for size, _ in points]
    at = bisect_left(sizes, rows)
    if at < len(points) and sizes[at] == rows:
        return points[at][1]
    if at == 0:
        return points[0][1]
    if at == len(points):
        return points[-1][1]
    (low, below), (high, above) = points[at - 1], points[at]
    share = (rows - low) / (high - low)
    return Line(
        below.fixed_ms + share * (above.fixed_ms - below.fixed_ms),
        below.step_ms + share * (above.step_ms - below.step_ms),
    )


@dataclass(frozen=True)
class CostProfile:
    """A call's time by its shape (see the module's docstring)."""

    name: str
    contract_ms: float = 0.0  # the contract's call, whatever its shape (a curve: 0)
    graph_buckets: tuple[int, ...] = ()
    graph_positions: int = 0  # the graphs' cache: prompt + new tokens - 1 must fit it
    graphs: tuple[tuple[int, Line], ...] = ()  # by bucket
    eager: tuple[tuple[int, Line], ...] = ()  # by rows
    prefill_ms_per_token: float = 0.0
    source: str = ""

    @property
    def is_contract(self) -> bool:
        return not self.graphs and not self.eager

    @classmethod
    def contract(cls, call_ms: float) -> CostProfile:
        return cls(CONTRACT, contract_ms=call_ms, source="the problem's contract")

    def bucket(self, rows: int) -> int:
        """The graph bucket a call of `rows` runs in (rows itself without graphs)."""
        for size in self.graph_buckets:
            if size >= rows:
                return size
        return rows

    def on_graphs(self, shape: Shape) -> bool:
        if not self.graphs or shape.rows > max(self.graph_buckets, default=0):
            return False
        new_tokens = shape.max_new_tokens or shape.steps
        return shape.prompt_tokens + new_tokens - 1 <= self.graph_positions

    def line(self, shape: Shape) -> tuple[Line, int]:
        """The call's line, and the rows it computes (its bucket's, on the graphs)."""
        if self.on_graphs(shape):
            bucket = self.bucket(shape.rows)
            return _between(list(self.graphs), bucket), bucket
        return _between(list(self.eager or self.graphs), shape.rows), shape.rows

    def prefill_ms(self, shape: Shape) -> float:
        """The call's time before its first token."""
        if self.is_contract:
            return 0.0
        line, rows = self.line(shape)
        return line.fixed_ms + self.prefill_ms_per_token * shape.prompt_tokens * rows

    def step_ms(self, shape: Shape) -> float:
        """One decode step's time (the contract's: the call spread over its steps)."""
        if self.is_contract:
            return self.contract_ms / max(1, shape.steps)
        return self.line(shape)[0].step_ms

    def call_ms(self, shape: Shape) -> float:
        if self.is_contract:
            return self.contract_ms
        return self.prefill_ms(shape) + self.step_ms(shape) * shape.steps

    @classmethod
    def of_json(cls, raw: dict[str, Any]) -> CostProfile:
        """A profile from its JSON: `graphs` and `eager` map a row count to {new tokens: ms}
        as the report measured them; the graphs' rows are taken to their bucket. Raises
        ValueError, saying what is wrong, for anything but positive counts and times."""
        if not isinstance(raw, dict):
            raise ValueError("a profile is a JSON object")
        buckets = tuple(sorted(_count(size, "graph_buckets") for size in
                               _listed(raw.get("graph_buckets", []))))  # fmt: skip
        profile = cls(str(raw["name"]), graph_buckets=buckets)

        def lines(table: object, bucketed: bool) -> tuple[Any, ...]:
            fitted = {}
            if not isinstance(table, dict):
                raise ValueError("graphs and eager map rows to {new tokens: ms}")
            for rows, times in table.items():
                size = profile.bucket(_count(rows, "rows")) if bucketed else _count(rows, "rows")
                if not isinstance(times, dict) or not times:
                    raise ValueError(f"rows {rows}: not a table of {{new tokens: ms}}")
                fitted[size] = Line.fit({_count(steps, "new tokens"): _time(ms)
                                         for steps, ms in times.items()})  # fmt: skip
            return tuple(sorted(fitted.items()))

        graphs = lines(raw.get("graphs", {}), bucketed=True)
        if graphs and not buckets:
            raise ValueError("graphs need graph_buckets")
        made = cls(
            name=profile.name,
            contract_ms=_time(raw.get("contract_ms", 0.0), zero=True),
            graph_buckets=buckets,
            graph_positions=_count(raw.get("graph_positions", 1), "graph_positions"),
            graphs=graphs,
            eager=lines(raw.get("eager", {}), bucketed=False),
            prefill_ms_per_token=_time(raw.get("prefill_ms_per_token", 0.0), zero=True),
            source=str(raw.get("source", "")),
        )
        if made.is_contract and made.contract_ms <= 0:
            raise ValueError("no graphs nor eager table, and no contract_ms above 0")
        return made


# A profile's bounds: what a sleep, a sum and a GPU count can hold.
MAX_COUNT, MAX_MS = 1_000_000, 3_600_000.0


def _listed(value: object) -> list[object]:
    if not isinstance(value, list):
        raise ValueError("graph_buckets is a list of row counts")
    return value


def _count(value: object, what: str) -> int:
    """A positive whole number (a JSON key's string too), at most MAX_COUNT."""
    text = str(value)
    if isinstance(value, bool) or not text.isascii() or not text.isdigit():
        raise ValueError(f"{what} must be a whole number above 0, got {value!r}")
    if not 1 <= int(text) <= MAX_COUNT:
        raise ValueError(f"{what} must be 1 to {MAX_COUNT:,}, got {value!r}")
    return int(text)


def _time(value: object, zero: bool = False) -> float:
    """A finite time in ms, above 0 (or 0 when `zero`), at most MAX_MS."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"a time must be a number of ms, got {value!r}")
    ms = float(value)
    if not (0 <= ms <= MAX_MS) or (ms == 0 and not zero):  # NaN fails both
        raise ValueError(f"a time must be above 0 and at most {MAX_MS:,.0f} ms, got {value!r}")
    return ms


def packaged_profiles() -> list[str]:
    return sorted(path.stem for path in PROFILES_DIR.glob("*.json"))


# A profile file's size at most: a report's tables are a few kilobytes.
MAX_PROFILE_BYTES = 1_000_000


def profile_path(name_or_path: str) -> Path:
    """A packaged profile's file, else `name_or_path` as a path (which may not exist)."""
    packaged = PROFILES_DIR / f"{name_or_path}.json"
    return packaged if packaged.is_file() else Path(name_or_path)


@cache
def _load(name_or_path: str) -> CostProfile:
    path = profile_path(name_or_path)
    if not path.is_file():
        raise ValueError(
            f"no cost profile {name_or_path!r}: {CONTRACT}, one of {packaged_profiles()}, "
            "or the path of a profile's JSON file"
        )
    try:
        with path.open("rb") as handle:
            text = handle.read(MAX_PROFILE_BYTES + 1)
        if len(text) > MAX_PROFILE_BYTES:
            raise ValueError(f"over {MAX_PROFILE_BYTES:,} bytes")
        return CostProfile.of_json(json.loads(text))
    except (OSError, RecursionError, ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
        raise ValueError(f"cost profile {str(path)!r} is not a profile: {exc}") from exc


def load_profile(name_or_path: str, contract_ms: float) -> CostProfile:
    """`contract` (every call `contract_ms`), a packaged profile's name, or a profile file's
    path. Raises ValueError for anything else."""
    if name_or_path == CONTRACT:
        return CostProfile.contract(contract_ms)
    return _load(name_or_path)
