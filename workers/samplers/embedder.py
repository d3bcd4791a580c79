"""Embedders: samplers whose answer for a row is its text's vector, not a continuation.

An embedder serves a model of kind `embedder` (batching.catalog) behind the same interface:
the worker calls `batched_complete(rows)` once per batch, as for a generator, and each row's
Completion carries its vector as text (batching.embeddings: float32, little-endian, base64),
with the row's tokens as its prompt tokens and no completion tokens. A row may ask for its
first `dimensions` values (normalized again, as OpenAI's `dimensions` does); more than the
model has is refused for that row alone.

`embed` is all an embedder implements: unit-length vectors, one per text, each independent
of the others in its call (a text's vector does not depend on what shares its batch).
"""

from __future__ import annotations

import abc
import hashlib
import random
import time
from collections.abc import Sequence

from batching.embeddings import encode, normalized, shortened
from batching.generation import Completion, FinishReason, Row
from workers.samplers.base import PromptRejected, Sampler


class Embedder(Sampler):
    #: the length of the model's own vectors
    dimensions: int = 0

    @abc.abstractmethod
    def embed(self, texts: list[str]) -> list[Sequence[float]]:
        """One unit-length vector of `dimensions` values per text, in order."""

    def sample(self, prompts: list[str]) -> list[str | PromptRejected]:
        return [encode(vector) for vector in self.embed(prompts)]

    def complete(self, rows: list[Row]) -> list[Completion | PromptRejected]:
        vectors = self.embed([row.prompt for row in rows])
        answers: list[Completion | PromptRejected] = []
        for row, vector in zip(rows, vectors, strict=True):
            wanted = row.settings.dimensions
            if wanted is not None and wanted > len(vector):
                answers.append(
                    PromptRejected(f"dimensions {wanted} is over the model's {len(vector)}")
                )
                continue
            text = encode(shortened(vector, wanted))
            answers.append(Completion(text, FinishReason.STOP, self.count_tokens(row.prompt), 0))
        return answers


class SimulatedEmbedder(Embedder):
    """The simulated sampler's embedder: each call takes `batch_ms`, and a text's vector is a
    deterministic draw from a hash of it (`expected_embedding`)."""

    name = "simulated-embedder"
    dimensions = 64

    def __init__(self, batch_ms: float = 100.0) -> None:
        self.batch_ms = batch_ms

    def embed(self, texts: list[str]) -> list[Sequence[float]]:
        started = time.perf_counter()
        vectors: list[Sequence[float]] = [expected_embedding(text) for text in texts]
        remaining = self.batch_ms / 1000 - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)
        return vectors


def expected_embedding(text: str, dimensions: int = SimulatedEmbedder.dimensions) -> list[float]:
    """The simulated embedder's vector of `text`: unit length, the same for the same text."""
    seed = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")
    stream = random.Random(seed)  # noqa: S311 - a stand-in for a model, not a secret
    return normalized([stream.gauss(0.0, 1.0) for _ in range(dimensions)])
