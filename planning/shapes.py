"""The shapes of the requests a plan serves: each one's prompt tokens and `max_tokens`, for a
cost profile (batching.call_cost) to price their calls with.

`--request-shapes` takes either ranges, `PROMPT_TOKENS:MAX_TOKENS` where each is a number or
`LOW-HIGH` (drawn uniformly, e.g. `20-199:16`), or the path of a file of requests, one
`PROMPT_TOKENS MAX_TOKENS` line each (blank lines and `#` comments skipped), drawn from at
random. A row decodes its `max_tokens`: the plan prices the longest calls its shapes allow.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from batching.call_cost import CostProfile, Shape


class ShapesError(ValueError):
    """Request shapes that cannot be read; the message says what is wrong."""


@dataclass(frozen=True)
class RequestShapes:
    """Prompt tokens and max tokens: ranges (`low`, `high` each), or a sample of pairs."""

    prompt: tuple[int, int] = (1, 1)
    max_tokens: tuple[int, int] = (1, 1)
    sample: tuple[tuple[int, int], ...] = ()
    spec: str = ""

    def draw(self, rng: random.Random) -> tuple[int, int]:
        if self.sample:
            return rng.choice(self.sample)
        return rng.randint(*self.prompt), rng.randint(*self.max_tokens)

    def call_ms(self, cost: CostProfile, shapes: list[tuple[int, int]]) -> float:
        """A call of rows of `shapes` on `cost`."""
        longest = max(prompt for prompt, _ in shapes)
        most = max(tokens for _, tokens in shapes)
        return cost.call_ms(Shape(len(shapes), longest, most, most))

    def mean_call_ms(self, cost: CostProfile, rows: int, seed: int = 1, calls: int = 200) -> float:
        """The mean call of `rows` rows drawn from these shapes (seeded)."""
        rng = random.Random(seed)  # noqa: S311 - a seeded estimate, not a secret
        total = sum(self.call_ms(cost, [self.draw(rng) for _ in range(rows)])
                    for _ in range(calls))  # fmt: skip
        return total / calls


def _range(text: str, what: str) -> tuple[int, int]:
    low, dash, high = text.partition("-")
    if not all(part.isascii() and part.isdigit() for part in ([low, high] if dash else [low])):
        raise ShapesError(f"{what} is a number or LOW-HIGH, got {text!r}")
    bounds = int(low), int(high or low)
    if not 1 <= bounds[0] <= bounds[1]:
        raise ShapesError(f"{what} must be 1 or more, LOW at most HIGH, got {text!r}")
    return bounds


def parse_shapes(spec: str) -> RequestShapes:
    """`PROMPT_TOKENS:MAX_TOKENS` ranges, or a file of `PROMPT_TOKENS MAX_TOKENS` lines."""
    if ":" in spec and not Path(spec).exists():
        prompt, _, tokens = spec.partition(":")
        return RequestShapes(_range(prompt, "PROMPT_TOKENS"), _range(tokens, "MAX_TOKENS"),
                             spec=spec)  # fmt: skip
    try:
        text = Path(spec).read_text()
    except OSError as exc:
        raise ShapesError(
            f"--request-shapes {spec}: not PROMPT_TOKENS:MAX_TOKENS, and {exc.strerror}"
        ) from None
    sample = []
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) != 2 or not all(
            field.isascii() and field.isdigit() and int(field) >= 1 for field in fields
        ):
            raise ShapesError(f"{spec}:{number}: a line is PROMPT_TOKENS MAX_TOKENS, got {line!r}")
        sample.append((int(fields[0]), int(fields[1])))
    if not sample:
        raise ShapesError(f"{spec}: no request in it")
    return RequestShapes(sample=tuple(sample), spec=spec)
