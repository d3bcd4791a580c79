"""The simulated sampler, logging when each call starts and ends (python -m bench gap).

A top-level module on purpose: bench/gap/runs.py puts this folder on a worker's PYTHONPATH and
loads it with SAMPLER=gap_sampler:TimedSampler, in this tree and in an older checkout alike,
so that one probe measures both versions of the worker.
"""

from __future__ import annotations

import os
import time

from django.conf import settings

from workers.samplers.base import PromptRejected
from workers.samplers.simulated import SimulatedSampler


class TimedSampler(SimulatedSampler):
    name = "timed-simulated"

    def __init__(self) -> None:
        super().__init__(batch_ms=settings.SIMULATED_BATCH_MS)
        # Line-buffered: one write of a few microseconds per call, read while the run goes on.
        self.log = open(os.environ["BENCH_CALL_LOG"], "a", buffering=1)  # noqa: SIM115

    def sample(self, prompts: list[str]) -> list[str | PromptRejected]:
        started = time.time()
        completions = super().sample(prompts)
        ended = time.time()
        # start end size first-prompt: the bench's prompts carry no newline.
        self.log.write(f"{started:.6f} {ended:.6f} {len(prompts)} {prompts[0]}\n")
        return completions
