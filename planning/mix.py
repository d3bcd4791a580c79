"""A mix of models for the capacity planner: each model's rate, deadline and call time, from
repeated `--model NAME:RPS:DEADLINE_MS[:CALL_MS]` options or a file of such lines (`--mix`;
blank lines and `#` comments skipped). Each model gets its own GPUs (a worker serves one
model), planned as the single-model plan is (planning.simulation); web nodes and Redis carry
the whole mix's rate."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class MixError(ValueError):
    """A model spec or mix file that cannot be read; the message says what is wrong."""


@dataclass(frozen=True)
class ModelLoad:
    name: str
    rps: float
    deadline_ms: float
    batch_ms: float


def parse_spec(spec: str, default_batch_ms: float) -> ModelLoad:
    parts = spec.strip().split(":")
    if len(parts) not in (3, 4) or not parts[0]:
        raise MixError(f"a model is NAME:RPS:DEADLINE_MS[:CALL_MS], got {spec!r}")
    try:
        numbers = [float(part) for part in parts[1:]]
    except ValueError:
        raise MixError(f"{spec!r}: RPS, DEADLINE_MS and CALL_MS are numbers") from None
    if any(number <= 0 for number in numbers):
        raise MixError(f"{spec!r}: RPS, DEADLINE_MS and CALL_MS must be above 0")
    batch_ms = numbers[2] if len(numbers) == 3 else default_batch_ms
    return ModelLoad(parts[0], numbers[0], numbers[1], batch_ms)


def read_mix(specs: list[str], path: str | None, default_batch_ms: float) -> list[ModelLoad]:
    """Every model of the options and the file, each name once."""
    lines = list(specs)
    if path:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise MixError(f"--mix {path}: {exc.strerror}") from None
        lines += [line.split("#", 1)[0] for line in text.splitlines()]
    loads = [parse_spec(line, default_batch_ms) for line in lines if line.strip()]
    names = [load.name for load in loads]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise MixError(f"a model is listed twice: {', '.join(repeated)}")
    return loads
