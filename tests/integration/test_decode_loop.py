"""The static decoder's loop on the CPU (its steps run eagerly, as a GPU replays them): tokens
chosen on the device and read back in chunks. Greedy answers and streamed text must be what
eager `generate` writes, past every chunk and width boundary; seeded rows must not depend on
their batch-mates; and a call must wait for the device a bounded number of times."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pytest
import torch

from batching.generation import Completion, Row, RowSettings
from tests.support.tiny_model import build_tiny_model
from workers.samplers.base import GenerationSettings, PromptRejected
from workers.samplers.hf import HFSampler
from workers.samplers.static_decode import CHUNK_STEPS, StaticDecoder, bucket_for

pytestmark = pytest.mark.integration

NEW_TOKENS = 32  # four chunks of CHUNK_STEPS and the smaller ones before them
# Multi-byte text in prompts and answers: random weights write tokens that decode to parts of
# characters, which streams must hold back.
PROMPTS = ["Le café est", "Once upon a time", "E equals ", "日本の首都は", "x", "🙂 emoji 🙂"]


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> HFSampler:
    """The tiny model with a 1,024-token context: its static caches have every width."""
    directory = build_tiny_model(tmp_path_factory.mktemp("tiny-wide"), context_tokens=1024)
    return HFSampler(str(directory), GenerationSettings(max_new_tokens=NEW_TOKENS), device="cpu")


@contextmanager
def static_path(sampler: HFSampler) -> Iterator[StaticDecoder]:
    assert sampler.use_static_cache(graphs=False)
    assert sampler.decoder is not None
    try:
        yield sampler.decoder
    finally:
        sampler.decoder = None


Answers = list[Completion | PromptRejected]


def streamed_call(sampler: HFSampler, rows: list[Row]) -> tuple[Answers, dict[int, list[str]]]:
    seen: dict[int, list[str]] = defaultdict(list)
    answers = sampler.batched_complete(rows, lambda row, text, *_: seen[row].append(text))
    return answers, dict(seen)


def mixed_batch(sampler: HFSampler, count: int) -> list[Row]:
    """Greedy rows with their own max tokens, stop strings taken from their own answers (so
    that they cut), sampled rows with seeds, and streaming rows among them."""
    base = [Row(f"{PROMPTS[i % len(PROMPTS)]} {i}", RowSettings(max_tokens=NEW_TOKENS))
            for i in range(count)]  # fmt: skip
    alone = sampler.batched_complete(base)
    rows = []
    for i, (row, answer) in enumerate(zip(base, alone, strict=True)):
        assert isinstance(answer, Completion)
        settings = row.settings
        if i % 4 == 1 and len(answer.text) > 20:  # a stop in the middle of the answer
            middle = len(answer.text) // 2
            settings = replace(settings, stop=(answer.text[middle : middle + 2], "never"))
        elif i % 4 == 2:
            settings = replace(settings, max_tokens=3 + i % 11)
        elif i % 4 == 3:
            settings = replace(settings, temperature=0.9, top_p=0.8, seed=i)
        rows.append(Row(row.prompt, settings, stream=i % 3 == 0))
    return rows


@pytest.mark.parametrize("count", [1, 9, 37])
def test_a_mixed_batch_writes_and_streams_what_generate_does(wide: HFSampler, count: int) -> None:
    rows = mixed_batch(wide, count)
    expected, expected_stream = streamed_call(wide, rows)
    with static_path(wide):
        answers, stream = streamed_call(wide, rows)
    assert answers == expected
    assert stream == expected_stream  # the same deltas, in the same pieces
    assert sum(len(deltas) for deltas in stream.values()) >= count // 3
    reasons = {a.finish_reason for a in answers if isinstance(a, Completion)}
    assert len(reasons) == (2 if count > 1 else 1)


def test_a_long_prompt_attends_over_a_wider_cache_and_writes_the_same(wide: HFSampler) -> None:
    """A prompt for each width: its prompt and new tokens fill 64, 128, 256 positions or
    more of the cache."""
    word = " and then"
    tokens = len(wide.tokenizer(word, add_special_tokens=False)["input_ids"])
    prompts = [f"Once{word * (length // tokens)}" for length in (20, 80, 200, 400)]
    expected = wide.batched_sample(prompts)
    alone_expected = [wide.batched_sample([prompt])[0] for prompt in prompts]
    with static_path(wide) as decoder:
        assert decoder.widths == [64, 128, 256, decoder.capacity]
        lengths = [len(wide.tokenizer(prompt)["input_ids"]) for prompt in prompts]
        used = {bucket_for(length + NEW_TOKENS - 1, decoder.widths) for length in lengths}
        assert used == set(decoder.widths)
        assert wide.batched_sample(prompts) == expected
        assert [wide.batched_sample([prompt])[0] for prompt in prompts] == alone_expected


def seeded(prompt: str, seed: int, temperature: float = 1.0) -> Row:
    return Row(
        prompt, RowSettings(max_tokens=NEW_TOKENS, temperature=temperature, top_p=0.95, seed=seed)
    )


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
def test_seeded_rows_draw_the_same_whatever_shares_their_call(
    wide: HFSampler, temperature: float
) -> None:
    rows = [seeded(f"{PROMPTS[i % 6]} {i}", 100 + i, temperature) for i in range(8)]
    greedy = [Row(PROMPTS[i % 6], RowSettings(max_tokens=5 + i)) for i in range(12)]
    eager_alone = [wide.batched_complete([row])[0] for row in rows]
    eager_batched = wide.batched_complete(rows)
    with static_path(wide):
        alone = [wide.batched_complete([row])[0] for row in rows]
        batched = wide.batched_complete(rows)
        shuffled = wide.batched_complete([*greedy[:5], *reversed(rows), *greedy[5:]])[5:13]
        other_seeds = wide.batched_complete(
            [seeded(f"{PROMPTS[i % 6]} {i}", 200 + i, temperature) for i in range(8)]
        )
    assert alone == batched == list(reversed(shuffled)) == eager_alone == eager_batched
    assert other_seeds != batched


def counting_host_reads(calls: dict[str, int]) -> Iterator[None]:
    """Counts every read of a tensor's value by the host: each is a wait for the device."""
    names = ("tolist", "item", "__bool__", "__int__", "__float__", "numpy", "cpu")
    originals: dict[str, Callable[..., Any]] = {name: getattr(torch.Tensor, name) for name in names}

    def counted(name: str) -> Callable[..., Any]:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            return originals[name](self, *args, **kwargs)

        return read

    for name in names:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_of_32_steps_waits_for_the_device_at_most_8_times(
    wide: HFSampler, stream: bool
) -> None:
    rows = [Row(f"{PROMPTS[i % 6]} {i}", RowSettings(max_tokens=NEW_TOKENS), stream=stream)
            for i in range(10)]  # fmt: skip
    rows[3] = replace(rows[3], settings=replace(rows[3].settings, temperature=0.7, seed=3))
    rows[5] = replace(rows[5], settings=replace(rows[5].settings, stop=("never written",)))
    with static_path(wide) as decoder:
        before = decoder.host_reads
        calls: dict[str, int] = {}
        with contextmanager(counting_host_reads)(calls):
            answers = wide.batched_complete(rows, (lambda *_: False) if stream else None)
        reads = decoder.host_reads - before
    assert wide.last_steps == NEW_TOKENS  # random weights: no row ended early
    assert all(isinstance(a, Completion) and a.completion_tokens == NEW_TOKENS for a in answers)
    assert reads <= 8
    assert sum(calls.values()) == reads, calls  # nothing else read a tensor
    assert reads > NEW_TOKENS // CHUNK_STEPS  # in chunks, not all at the end
