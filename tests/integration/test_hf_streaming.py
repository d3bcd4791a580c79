"""The transformers sampler streams: with the packaged SmolLM2 on the CPU, on eager
`generate` and on the static-cache path, a mixed batch (streaming rows beside one that does
not stream) gets the same answers as without streaming, and each streaming row's deltas are
its answer's text as it grew: never half a character, never the start of its stop string,
and all of the answer but what only the final token could settle."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest

from batching.generation import Completion, FinishReason, Row
from batching.streaming import INCOMPLETE_CHARACTER
from workers.samplers.hf import HFSampler

pytestmark = pytest.mark.integration

# Prompts whose greedy answers hold characters of two and three bytes.
PROMPTS = ["Le café est", "Once upon a time", "E equals ", "日本の首都は"]


@contextmanager
def on_path(sampler: HFSampler, path: str) -> Iterator[None]:
    if path == "static":  # the static caches' steps, run eagerly on the CPU
        assert sampler.use_static_cache(graphs=False)
    try:
        yield
    finally:
        sampler.decoder = None


@pytest.mark.parametrize("path", ["eager", "static"])
def test_streamed_text_is_the_answer_as_it_grew_row_by_row(smollm2: HFSampler, path: str) -> None:
    settings = smollm2.row_settings()
    with on_path(smollm2, path):
        free = smollm2.batched_complete([Row(prompt, settings) for prompt in PROMPTS])
        first = free[0]
        assert isinstance(first, Completion)
        # A stop string in the middle of the first row's answer: it ends there instead.
        middle = len(first.text) // 2
        stop = first.text[middle : middle + 3]
        rows = [
            Row(PROMPTS[0], replace(settings, stop=(stop,)), stream=True),
            Row(PROMPTS[1], settings, stream=True),
            Row(PROMPTS[2], settings),  # does not stream
            Row(PROMPTS[3], settings, stream=True),
        ]
        plain = smollm2.batched_complete(rows)
        seen: dict[int, list[str]] = defaultdict(list)
        streamed = smollm2.batched_complete(rows, lambda row, text, *_: seen[row].append(text))
    assert streamed == plain
    assert set(seen) == {0, 1, 3}
    answers = [answer for answer in plain if isinstance(answer, Completion)]
    assert len(answers) == len(rows)
    assert answers[0].finish_reason == FinishReason.STOP
    for row, deltas in seen.items():
        sent, final = "".join(deltas), answers[row].text
        assert final.startswith(sent)
        assert len(deltas) >= 3
        assert INCOMPLETE_CHARACTER not in sent
        unsent = final[len(sent) :]
        if row == 0:  # at most what could still have been the start of the stop string
            assert len(unsent) < len(stop)
        else:  # at most a character whose other bytes the call never sampled
            assert unsent.strip(INCOMPLETE_CHARACTER) == ""
    multibyte = "".join(seen[0] + seen[3])
    assert any(len(character.encode()) > 1 for character in multibyte), multibyte
