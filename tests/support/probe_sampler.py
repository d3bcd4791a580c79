"""A sampler for the tests, loaded by a real worker with SAMPLER=tests.probe_sampler:ProbeSampler.

It is the simulated sampler plus two probes: it records every prompt it is given in a Redis
list (so a test can prove that expired items never reached it), and it raises for a batch
that contains a prompt starting with "raise:" (so a test can see a failing sampler).
"""

from __future__ import annotations

import redis
from django.conf import settings

from workers.samplers.base import PromptRejected
from workers.samplers.simulated import SimulatedSampler


def seen_key(queue: str) -> str:
    return f"probe:{{{queue}}}:seen"


class ProbeSampler(SimulatedSampler):
    name = "probe"

    def __init__(self) -> None:
        super().__init__(batch_ms=settings.SIMULATED_BATCH_MS)
        self.client = redis.Redis.from_url(settings.REDIS_URL)
        self.key = seen_key(settings.SAMPLING_QUEUE)

    def sample(self, prompts: list[str]) -> list[str | PromptRejected]:
        self.client.rpush(self.key, *prompts)
        if any(prompt.startswith("raise:") for prompt in prompts):
            raise RuntimeError("probe sampler asked to fail")
        return super().sample(prompts)
