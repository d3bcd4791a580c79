"""The baselines' Celery tasks, each a call of the simulated sampler (SIMULATED_BATCH_MS)."""

from __future__ import annotations

import time
from functools import cache

import redis
from celery import shared_task
from celery_batches import Batches
from django.conf import settings

from bench.baselines import calls_key
from bench.baselines import settings as bench_settings
from workers.samplers.simulated import SimulatedSampler


@cache
def _sampler() -> SimulatedSampler:
    return SimulatedSampler(batch_ms=settings.SIMULATED_BATCH_MS)


@cache
def _redis() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL)


def sample(prompts: list[str]) -> list[str]:
    """One sampler call, recorded as "size sampler_ms" for the benchmark's batch figures."""
    started = time.perf_counter()
    completions = _sampler().batched_sample(prompts)
    sampler_ms = (time.perf_counter() - started) * 1000
    _redis().rpush(calls_key(settings.SAMPLING_QUEUE), f"{len(prompts)} {sampler_ms:.2f}")
    return [str(c) for c in completions]


@shared_task(name="baseline.sample_one")
def sample_one(prompt: str) -> str:
    """One Celery task per request: a batch of one."""
    return sample([prompt])[0]


@shared_task(name="baseline.sample_prompts")
def sample_prompts(prompts: list[str]) -> list[str]:
    """A batch formed by the web process's timer batcher."""
    return sample(prompts)


@shared_task(
    name="baseline.sample_batched",
    base=Batches,
    flush_every=bench_settings.BENCH_FLUSH_EVERY,
    flush_interval=bench_settings.BENCH_FLUSH_INTERVAL_MS / 1000,
)
def sample_batched(requests: list) -> None:
    """celery-batches: the worker buffers messages and calls this with up to flush_every of
    them; each result must be stored by hand (celery-batches #20)."""
    completions = sample([request.args[0] for request in requests])
    backend = sample_batched.backend
    for request, completion in zip(requests, completions, strict=True):
        backend.mark_as_done(request.id, completion, request=request)
