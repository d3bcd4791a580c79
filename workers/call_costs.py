"""A worker's predictions of its calls by their shape (batching.call_cost), and what it learns
of them: the deadline cut before a call, when its GPU frees, and which backfill lines a top-up
may take.

Under the contract a call costs the same whatever its rows: the prediction is the running mean
of the queue's calls (the runner's `estimate_ms`). On a curve, it is the profile's time for the
call's shape, scaled by what this GPU's calls of the queue measured against the profile.
"""

from __future__ import annotations

from collections.abc import Sequence

from batching.call_cost import CostProfile, Shape
from batching.generation import Row
from workers.samplers.base import Sampler

# Weight of the newest call in the running estimates of a call.
ESTIMATE_WEIGHT = 0.3
# How much longer, at most, a seal's top-up with backfill items may make an interactive call,
# on the worker's cost profile (SAMPLING_BACKFILL_EXTRA_COST_PCT).
BACKFILL_EXTRA_COST_PCT = 5.0


class CallCosts:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.profile: CostProfile = sampler.cost_profile or CostProfile.contract(100.0)
        self.scale = 1.0  # measured / predicted, over the queue's calls (a curve's)
        self.backfill_extra_cost_pct = BACKFILL_EXTRA_COST_PCT
        self._sizes: dict[tuple[int, int, float], list[int]] = {}  # top_up_sizes

    def shape(self, rows: Sequence[Row]) -> Shape:
        """A call of `rows`: their number, the longest prompt, the most new tokens any asks
        (the steps it may run)."""
        if not rows:
            return Shape(0, 0, 0)
        most = max(row.settings.max_tokens for row in rows)
        longest = max(self.sampler.count_tokens(row.prompt) for row in rows)
        return Shape(len(rows), longest, most, most)

    def profile_ms(self, rows: Sequence[Row]) -> float:
        """The profile's time for a call of `rows`, unscaled."""
        if not rows:
            return 0.0
        if self.profile.is_contract:
            return self.profile.contract_ms
        return self.profile.call_ms(self.shape(rows))

    def predict_ms(self, rows: Sequence[Row], running_mean_ms: float) -> float:
        """A call of `rows` on this GPU (`running_mean_ms`: the contract's prediction)."""
        if not rows:
            return 0.0
        if self.profile.is_contract:
            return running_mean_ms
        return self.scale * self.profile_ms(rows)

    def learn(self, rows: Sequence[Row], queue_rows: Sequence[Row], sampler_ms: float) -> float:
        """A call of `rows` took `sampler_ms`; `queue_rows` of them were the queue's requests
        (the rest a top-up's backfill lines). The scale learns from it; returns the share of
        its time the profile gives the queue's rows alone."""
        whole = self.profile_ms(rows)
        if whole and not self.profile.is_contract:
            self.scale += ESTIMATE_WEIGHT * (sampler_ms / whole - self.scale)
        return self.profile_ms(queue_rows) / whole if whole else 1.0

    def top_up_sizes(self, max_rows: int, steps: int) -> list[int]:
        """The sizes a seal may top a batch up to (the smallest that holds its items): on a
        curve, for each graph bucket, the most rows whose call costs at most the margin more
        than the bucket's; under the contract, `max_rows`."""
        if self.profile.is_contract:
            return [max_rows]
        key = (max_rows, steps, self.backfill_extra_cost_pct)
        if key not in self._sizes:
            buckets = [b for b in self.profile.graph_buckets if b < max_rows] + [max_rows]
            if not self.profile.graph_buckets:
                buckets = list(range(1, max_rows + 1))
            self._sizes[key] = sorted({self._rows_costing(b, max_rows, steps) for b in buckets})
        return self._sizes[key]

    def _rows_costing(self, rows: int, max_rows: int, steps: int) -> int:
        bound = self.profile.call_ms(Shape(rows, 0, steps)) * (
            1 + self.backfill_extra_cost_pct / 100
        )
        return max(r for r in range(rows, max_rows + 1)
                   if self.profile.call_ms(Shape(r, 0, steps)) <= bound)  # fmt: skip

    def rows_within(self, call_ms: float, max_rows: int, steps: int) -> int:
        """The most rows (1 at least) of `steps` new tokens whose call costs no more than
        `call_ms` on this GPU, with the top-up's margin (the contract's: `max_rows`)."""
        if self.profile.is_contract:
            return max_rows
        bound = call_ms / self.scale * (1 + self.backfill_extra_cost_pct / 100)
        fitting = [rows for rows in range(1, max_rows + 1)
                   if self.profile.call_ms(Shape(rows, 0, steps)) <= bound]  # fmt: skip
        return max(fitting, default=1)

    def fitting(
        self, rows: Sequence[Row], candidates: Sequence[Row | None]
    ) -> tuple[list[bool], Shape]:
        """Which `candidates` (in order) a call of `rows` may take: each while the call's
        profile time stays within `backfill_extra_cost_pct` of the rows' alone; and the
        call's shape with them. A None (a line that makes no row: rejected alone, at no
        cost) always fits. Under the contract, every candidate."""
        shape = self.shape(rows)
        if self.profile.is_contract:
            return [True] * len(candidates), shape
        bound = self.profile.call_ms(shape) * (1 + self.backfill_extra_cost_pct / 100)
        fits = []
        for row in candidates:
            if row is None:
                fits.append(True)
                continue
            tokens = row.settings.max_tokens
            grown = Shape(
                shape.rows + 1,
                max(shape.prompt_tokens, self.sampler.count_tokens(row.prompt)),
                max(shape.steps, tokens),
                max(shape.max_new_tokens, tokens),
            )
            fits.append(self.profile.call_ms(grown) <= bound)
            if fits[-1]:
                shape = grown
        return fits, shape
