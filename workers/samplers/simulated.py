"""The simulated sampler: the problem's contract, without a model.

Each call takes SIMULATED_BATCH_MS whatever the batch size (the GPU is busy for the whole
call) and returns deterministic, prompt-specific completions, so a test or a benchmark can
check that every answer went back to the request that asked for it.
"""

from __future__ import annotations

import hashlib
import time

from workers.samplers.base import PromptRejected, Sampler

KNOWN_COMPLETIONS = {
    "E equals ": "MC squared",
    "For every action, there is ": "an equal and opposite reaction",
}

_WORDS = [
    "amber",
    "basalt",
    "cobalt",
    "delta",
    "ember",
    "fjord",
    "garnet",
    "harbor",
    "indigo",
    "juniper",
    "kestrel",
    "lumen",
    "meadow",
    "nimbus",
    "onyx",
    "prism",
    "quartz",
    "raven",
    "sierra",
    "tundra",
    "umber",
    "vertex",
    "willow",
    "xenon",
    "yarrow",
    "zephyr",
]


def expected_completion(prompt: str) -> str:
    """The completion the simulated sampler gives `prompt`: a known answer, else three words
    drawn from a hash of the prompt followed by its length, so distinct prompts get distinct
    answers."""
    known = KNOWN_COMPLETIONS.get(prompt)
    if known is not None:
        return known
    digest = hashlib.blake2b(prompt.encode("utf-8"), digest_size=6).digest()
    words = [_WORDS[digest[i] % len(_WORDS)] for i in range(3)]
    return f"{' '.join(words)} {digest.hex()[:6]} ({len(prompt)} chars)"


class SimulatedSampler(Sampler):
    name = "simulated"

    def __init__(self, batch_ms: float = 100.0) -> None:
        self.batch_ms = batch_ms

    def sample(self, prompts: list[str]) -> list[str | PromptRejected]:
        started = time.perf_counter()
        completions: list[str | PromptRejected] = [expected_completion(p) for p in prompts]
        remaining = self.batch_ms / 1000 - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)
        return completions
