from __future__ import annotations

import base64
import math
import struct

import pytest

from batching.embeddings import decode, encode, normalized, shortened
from batching.generation import FinishReason, Row, RowSettings, SampleRequest
from batching.policy import GenerationSettings
from workers.samplers.base import PromptRejected
from workers.samplers.embedder import SimulatedEmbedder, expected_embedding


def test_an_embedding_travels_as_openai_s_base64_of_little_endian_float32() -> None:
    vector = [0.5, -0.25, 1e-3, 3.0]
    text = encode(vector)
    raw = base64.b64decode(text)
    assert struct.unpack("<4f", raw) == pytest.approx(vector, rel=1e-7)
    assert decode(text) == list(struct.unpack("<4f", raw))


def test_dimensions_keep_the_first_values_at_unit_length() -> None:
    vector = normalized([3.0, 4.0, 12.0])
    assert math.fsum(x * x for x in vector) == pytest.approx(1.0)
    assert shortened(vector, 2) == pytest.approx([0.6, 0.8])
    assert shortened(vector, None) == vector
    assert shortened(vector, 5) == vector


def rows(*texts: str, dimensions: int | None = None) -> list[Row]:
    settings = SampleRequest(dimensions=dimensions).settings(GenerationSettings())
    return [Row(text, settings) for text in texts]


def test_the_simulated_embedder_answers_each_text_s_vector_whatever_shares_its_call() -> None:
    embedder = SimulatedEmbedder(batch_ms=0)
    alone = embedder.batched_complete(rows("hello world"))
    crowded = embedder.batched_complete(rows("other", "hello world", "a third text"))
    assert alone[0] == crowded[1]
    answer = alone[0]
    assert not isinstance(answer, PromptRejected)
    assert (answer.finish_reason, answer.prompt_tokens, answer.completion_tokens) == (
        FinishReason.STOP, 2, 0
    )  # fmt: skip
    assert decode(answer.text) == pytest.approx(expected_embedding("hello world"), abs=1e-6)
    assert len(decode(answer.text)) == SimulatedEmbedder.dimensions
    assert expected_embedding("hello world") != expected_embedding("hello world!")


def test_a_row_asks_for_fewer_dimensions_and_more_than_the_model_has_is_refused_alone() -> None:
    embedder = SimulatedEmbedder(batch_ms=0)
    (short,) = embedder.batched_complete(rows("x", dimensions=8))
    assert not isinstance(short, PromptRejected)
    assert decode(short.text) == pytest.approx(shortened(expected_embedding("x"), 8), abs=1e-6)
    over = embedder.batched_complete(rows("x", "y", dimensions=65))
    assert all(isinstance(answer, PromptRejected) for answer in over)
    assert "65" in str(over[0])


def test_a_request_s_dimensions_reach_the_row() -> None:
    request = SampleRequest(prompt="x", dimensions=12)
    assert SampleRequest.from_json(request.to_json()) == request
    assert request.settings(GenerationSettings()) == RowSettings(
        max_tokens=GenerationSettings().max_new_tokens, dimensions=12
    )
