"""How the simulated GPU prices its calls in a benchmark: the problem's contract (every call
`call_ms`), or a cost profile (batching.call_cost) on which every request asks CURVE_TOKENS
new tokens and gets a longer completion, as real requests do."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from batching.call_cost import CONTRACT, CostProfile, Shape, load_profile
from workers.samplers.simulated import expected_completion

# On a cost curve: every row's new tokens (a job's lines ask 16 too), its completions longer.
CURVE_TOKENS, CURVE_EXTRA_WORDS = 16, 40
# A benchmark's prompts: a few words, about this many tokens.
PROMPT_TOKENS = 8


@dataclass(frozen=True)
class Calls:
    """A benchmark's calls: `cost` (contract, a packaged profile or a file), `call_ms` the
    contract's call, `max_batch` rows at most."""

    cost: str = CONTRACT
    call_ms: float = 100.0
    max_batch: int = 100

    @cached_property
    def profile(self) -> CostProfile:
        return load_profile(self.cost, self.call_ms)

    @property
    def on_curve(self) -> bool:
        return not self.profile.is_contract

    @property
    def full_call_ms(self) -> float:
        """A call of `max_batch` rows: `call_ms`, or on a curve its profile's time."""
        if not self.on_curve:
            return self.call_ms
        return self.profile.call_ms(Shape(self.max_batch, PROMPT_TOKENS, CURVE_TOKENS))

    def limit_rps(self, workers: int = 1) -> float:
        """Requests a second that `workers` GPUs serve in full calls back to back."""
        return workers * self.max_batch * 1000 / self.full_call_ms

    def env(self) -> dict[str, str]:
        """The stack's settings for a curve (none under the contract)."""
        if not self.on_curve:
            return {}
        return {"SIMULATED_COST": self.cost, "SIMULATED_EXTRA_WORDS": str(CURVE_EXTRA_WORDS),
                "SAMPLING_MAX_NEW_TOKENS": str(CURVE_TOKENS)}  # fmt: skip

    def expected(self) -> Callable[[str], str]:
        """A prompt's simulated completion under these calls."""
        extra = CURVE_EXTRA_WORDS if self.on_curve else 0
        return lambda prompt: expected_completion(prompt, extra)

    def describe(self) -> str:
        if not self.on_curve:
            return f"{self.call_ms:g} ms calls"
        return f"calls on the {self.cost} curve ({self.full_call_ms:.1f} ms full)"
