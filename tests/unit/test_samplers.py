from __future__ import annotations

import time

import pytest
from django.core.exceptions import ImproperlyConfigured

from workers.samplers import load_sampler
from workers.samplers.base import MAX_BATCH
from workers.samplers.simulated import SimulatedSampler, expected_completion


def test_known_completions() -> None:
    sampler = SimulatedSampler(batch_ms=0)
    assert sampler.batched_sample(["E equals ", "For every action, there is "]) == [
        "MC squared",
        "an equal and opposite reaction",
    ]


def test_completions_are_deterministic_and_prompt_specific() -> None:
    sampler = SimulatedSampler(batch_ms=0)
    prompts = [f"prompt {i}" for i in range(MAX_BATCH)]
    first = sampler.batched_sample(prompts)
    assert first == sampler.batched_sample(prompts)
    assert len(set(first)) == MAX_BATCH
    assert first == [expected_completion(p) for p in prompts]


def test_contract_bounds() -> None:
    sampler = SimulatedSampler(batch_ms=0)
    with pytest.raises(ValueError, match="at least one"):
        sampler.batched_sample([])
    with pytest.raises(ValueError, match="at most 100"):
        sampler.batched_sample(["p"] * (MAX_BATCH + 1))


def test_a_call_costs_the_same_whatever_the_batch_size() -> None:
    sampler = SimulatedSampler(batch_ms=50)
    durations = []
    for size in (1, 100):
        started = time.perf_counter()
        sampler.batched_sample(["p"] * size)
        durations.append(time.perf_counter() - started)
    assert all(0.05 <= d < 0.09 for d in durations), durations


def test_load_sampler_by_name_and_path(settings: object) -> None:
    assert isinstance(load_sampler("simulated"), SimulatedSampler)
    with pytest.raises(ImproperlyConfigured, match="SAMPLER"):
        load_sampler("no-such-sampler")
    with pytest.raises(ImproperlyConfigured, match="cannot be loaded"):
        load_sampler("no_such_module:factory")
    with pytest.raises(ImproperlyConfigured, match="did not build"):
        load_sampler("builtins:dict")
