"""A sampler for the tests whose every completion starts with the name of the model it serves
(its worker's SAMPLING_QUEUE): two models of one stack answer differently, and an answer says
which model made it. Loaded by a real worker with SAMPLER=tests.support.named_sampler:named."""

from __future__ import annotations

from dataclasses import replace

from django.conf import settings

from batching.generation import Completion, Row
from workers.samplers.base import PromptRejected
from workers.samplers.simulated import SimulatedSampler


class NamedSampler(SimulatedSampler):
    name = "named"

    def complete(self, rows: list[Row]) -> list[Completion | PromptRejected]:
        return [
            answer
            if isinstance(answer, PromptRejected)
            else replace(answer, text=f"{settings.SAMPLING_QUEUE}: {answer.text}")
            for answer in super().complete(rows)
        ]


def named() -> NamedSampler:
    return NamedSampler(batch_ms=settings.SIMULATED_BATCH_MS)
