"""A sampler for the tests whose every completion starts with the name of the model it serves
(its worker's SAMPLING_QUEUE): two models of one stack answer differently, and an answer says
which model made it. Loaded by a real worker with SAMPLER=tests.support.named_sampler:named;
`flaky` fails one row in five (by a hash of its prompt: RowFailed, a 502 for that request
alone), as a bad new version of a model might."""

from __future__ import annotations

import hashlib
from dataclasses import replace

from django.conf import settings

from batching.generation import Completion, Row
from workers.samplers.base import PromptRejected, RowFailed
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


class FlakySampler(NamedSampler):
    name = "flaky"

    def complete(self, rows: list[Row]) -> list[Completion | PromptRejected]:
        return [
            RowFailed("this version fails one prompt in five") if fails(row.prompt) else answer
            for row, answer in zip(rows, super().complete(rows), strict=True)
        ]


def fails(prompt: str) -> bool:
    return hashlib.blake2b(prompt.encode(), digest_size=2).digest()[0] % 5 == 0


def named() -> NamedSampler:
    return NamedSampler(batch_ms=settings.SIMULATED_BATCH_MS)


def flaky() -> FlakySampler:
    return FlakySampler(batch_ms=settings.SIMULATED_BATCH_MS)
