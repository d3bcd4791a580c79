"""A sampler for the tests, loaded by a real worker with SAMPLER=tests.probe_sampler:ProbeSampler.

It is the simulated sampler plus probes, each triggered by a prompt's prefix:
  - every prompt it is given is recorded in a Redis list (so a test can prove that expired
    items never reached it);
  - "raise:" fails the call (a failing sampler);
  - "hang:" never returns (a hung call: a CUDA kernel that never ends);
  - "slow:" takes SLOW_MS instead of the usual call;
  - a policy whose max_new_tokens leaves no room in its CONTEXT_TOKENS is refused, as a
    model's sampler refuses one past its context (ValueError, the settings kept).
A hung or slow call first records its prompts and this process's pid (`stuck_call_key`), so a
test knows which worker runs it and which requests it holds.
"""

from __future__ import annotations

import json
import os
import threading
import time

import redis
from django.conf import settings

from batching.policy import GenerationSettings
from workers.samplers.base import PromptRejected
from workers.samplers.simulated import SimulatedSampler

SLOW_MS = 1500
CONTEXT_TOKENS = 2048


def seen_key(queue: str) -> str:
    return f"probe:{{{queue}}}:seen"


def stuck_call_key(queue: str) -> str:
    """A JSON {"pid", "prompts", "started_at"} of the last hung or slow call, written as it
    starts (started_at: epoch seconds)."""
    return f"probe:{{{queue}}}:stuck-call"


class ProbeSampler(SimulatedSampler):
    name = "probe"

    def __init__(self) -> None:
        super().__init__(batch_ms=settings.SIMULATED_BATCH_MS)
        self.client = redis.Redis.from_url(settings.REDIS_URL)
        self.queue = settings.SAMPLING_QUEUE

    def configure(self, generation: GenerationSettings) -> None:
        if generation.max_new_tokens >= CONTEXT_TOKENS:
            raise ValueError(
                f"max new tokens ({generation.max_new_tokens}) leaves no room for a prompt "
                f"in the probe's {CONTEXT_TOKENS}-token context"
            )
        super().configure(generation)

    def sample(self, prompts: list[str]) -> list[str | PromptRejected]:
        self.client.rpush(seen_key(self.queue), *prompts)
        if any(prompt.startswith("raise:") for prompt in prompts):
            raise RuntimeError("probe sampler asked to fail")
        hang = any(prompt.startswith("hang:") for prompt in prompts)
        slow = any(prompt.startswith("slow:") for prompt in prompts)
        if hang or slow:
            call = {"pid": os.getpid(), "prompts": prompts, "started_at": time.time()}
            self.client.set(stuck_call_key(self.queue), json.dumps(call))
        if hang:
            threading.Event().wait()  # duration: forever, a hung call
        if slow:
            time.sleep(SLOW_MS / 1000)  # duration: a slow call
        return super().sample(prompts)
