"""The sampler interface: `batched_sample(prompts) -> completions`, 1 to 100 prompts a call.

A sampler implements one method, `sample`. The checks of the contract (batch size, result
length) live here and in workers.runner, so no sampler repeats them.
"""

from __future__ import annotations

import abc
import time

from batching.policy import MAX_BATCH_SIZE, GenerationSettings

# The contract's bound, named for samplers (one home: batching.policy).
MAX_BATCH = MAX_BATCH_SIZE

__all__ = ["MAX_BATCH", "GenerationSettings", "PromptRejected", "Sampler"]


class PromptRejected(Exception):
    """Returned (not raised) in place of one completion the sampler cannot produce for that
    prompt alone, e.g. a prompt longer than the model's context. The rest of the batch stands."""


class Sampler(abc.ABC):
    #: a short name for logs and the worker's heartbeat
    name: str = "sampler"
    #: the settings the next call uses; a sampler without generation settings ignores them
    generation: GenerationSettings = GenerationSettings()

    def configure(self, generation: GenerationSettings) -> None:
        """Use `generation` from the next call on (the worker calls it between calls when the
        policy changes). Raises ValueError, keeping the current settings, if they cannot
        apply."""
        self.generation = generation

    def batched_sample(self, prompts: list[str]) -> list[str | PromptRejected]:
        if not prompts:
            raise ValueError("batched_sample needs at least one prompt")
        if len(prompts) > MAX_BATCH:
            raise ValueError(
                f"batched_sample takes at most {MAX_BATCH} prompts, got {len(prompts)}"
            )
        return self.sample(prompts)

    @abc.abstractmethod
    def sample(self, prompts: list[str]) -> list[str | PromptRejected]:
        """One completion (or PromptRejected) per prompt, in order."""

    def warm_up(self) -> float:
        """Run one call so the first request does not pay for lazy initialisation; returns its
        duration in ms, the worker's first estimate of a sampling call."""
        started = time.perf_counter()
        self.batched_sample(["warm-up"])
        return (time.perf_counter() - started) * 1000
