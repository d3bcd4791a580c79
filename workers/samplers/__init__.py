"""Sampler selection: SAMPLER names a built-in sampler or a dotted path `module:factory`."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from workers.samplers.base import MAX_BATCH, GenerationSettings, PromptRejected, Sampler


def _simulated() -> Sampler:
    from batching.call_cost import load_profile
    from workers.samplers.simulated import SimulatedSampler

    return SimulatedSampler(
        batch_ms=settings.SIMULATED_BATCH_MS,
        extra_words=settings.SIMULATED_EXTRA_WORDS,
        cost=load_profile(settings.SIMULATED_COST, settings.SIMULATED_BATCH_MS),
    )


def _hf() -> Sampler:
    from workers.samplers.hf import HFSampler

    return HFSampler(
        settings.SAMPLING_MODEL,
        GenerationSettings(
            max_new_tokens=settings.SAMPLING_MAX_NEW_TOKENS,
            temperature=settings.SAMPLING_TEMPERATURE,
            top_p=settings.SAMPLING_TOP_P,
            stop=settings.SAMPLING_STOP,
        ),
        cuda_graphs=settings.SAMPLING_CUDA_GRAPHS,
        graph_prompt_tokens=settings.SAMPLING_CUDA_GRAPH_PROMPT_TOKENS,
    )


def _simulated_embedder() -> Sampler:
    from workers.samplers.embedder import SimulatedEmbedder

    return SimulatedEmbedder(batch_ms=settings.SIMULATED_BATCH_MS)


def _hf_embedder() -> Sampler:
    from workers.samplers.hf_embedder import HFEmbedder

    return HFEmbedder(settings.SAMPLING_MODEL)


# Imported lazily: a web process never loads torch. The embedders' names are those
# batching.catalog.EMBEDDING_SAMPLERS knows as embedders.
BUILT_IN: dict[str, Callable[[], Sampler]] = {
    "hf": _hf,
    "simulated": _simulated,
    "hf-embedder": _hf_embedder,
    "simulated-embedder": _simulated_embedder,
}


def load_sampler(name: str | None = None) -> Sampler:
    name = name or settings.SAMPLER
    factory = BUILT_IN.get(name)
    if factory is None:
        module_name, _, attribute = name.partition(":")
        if not attribute:
            raise ImproperlyConfigured(
                f"SAMPLER must be one of {sorted(BUILT_IN)} or 'module:factory', got {name!r}"
            )
        try:
            factory = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as exc:
            raise ImproperlyConfigured(f"SAMPLER {name!r} cannot be loaded: {exc}") from exc
    sampler = factory()
    if not isinstance(sampler, Sampler):
        raise ImproperlyConfigured(f"SAMPLER {name!r} did not build a workers.samplers.Sampler")
    return sampler


__all__ = [
    "BUILT_IN",
    "MAX_BATCH",
    "GenerationSettings",
    "PromptRejected",
    "Sampler",
    "load_sampler",
]
