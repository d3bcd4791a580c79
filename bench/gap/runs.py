"""One gap run's settings, its stacks and the figures it records (bench.gap)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness.stack import Stack, simulated_env, simulated_stack
from bench.harness.trees import Tree

# The timed sampler (shims/gap_sampler.py), put on the workers' PYTHONPATH by this tree in
# an older checkout too: one probe measures both versions.
SHIMS = Path(__file__).resolve().parents[1] / "shims"
CALL_MS = 100
MAX_BATCH = 100


@dataclass
class Bench:
    redis_url: str
    rounds: int
    saturated_s: float
    lone_s: float
    single_requests: int
    work: Path
    figures: dict[tuple[str, str], list[dict[str, float]]] = field(default_factory=dict)

    def env(self, queue: str, log: Path, **extra: str) -> dict[str, str]:
        env = simulated_env(
            self.redis_url, queue, call_ms=CALL_MS, max_batch=MAX_BATCH,
            SAMPLER="gap_sampler:TimedSampler", BENCH_CALL_LOG=str(log), PYTHONPATH=str(SHIMS),
        )  # fmt: skip
        return {**env, **extra}

    def record(self, tree: Tree, scenario: str, figures: dict[str, float]) -> None:
        self.figures.setdefault((tree.name, scenario), []).append(figures)
        shown = "  ".join(f"{name} {value:.2f}" for name, value in figures.items())
        print(f"  {tree.name:<8} {scenario:<10} {shown}", flush=True)

    @contextmanager
    def stack(
        self, tree: Tree, scenario: str, gpus: list[int | None], env: dict[str, str] | None = None
    ) -> Iterator[tuple[Stack, Path]]:
        """A stack of `tree`'s code, not started, with the timing sampler logging to the
        returned file."""
        queue = f"gap-{scenario}-{uuid.uuid4().hex[:8]}"
        log = self.work / f"{queue}.calls"
        log.touch()
        stack = simulated_stack(
            self.env(queue, log, **(env or {})), gpus, root=tree.root, log_dir=self.work / queue
        )
        try:
            yield stack, log
        finally:
            stack.stop()
