"""The static-cache path's bookkeeping, without a model: buckets, padding, masks, positions,
and the settings that choose it."""

from __future__ import annotations

from pathlib import Path

import torch
from django.conf import settings

from tests.unit.test_settings import manage_check
from workers.samplers.base import MAX_BATCH
from workers.samplers.hf import CUDA_GRAPH_MODES
from workers.samplers.static_decode import (
    CHUNK_STEPS,
    DECODE_WIDTHS,
    DEFAULT_PROMPT_TOKENS,
    GRAPH_BATCH_SIZES,
    bucket_for,
    chunk_sizes,
    decode_widths,
    left_padded,
    prefill_mask,
    prompt_positions,
)

PAD = 7


def test_a_call_takes_the_smallest_bucket_that_holds_it() -> None:
    buckets = [100, 1, 8, 16]
    assert [bucket_for(rows, buckets) for rows in (1, 2, 8, 9, 16, 17, 37, 100)] == [
        1, 8, 8, 16, 16, 100, 100, 100,
    ]  # fmt: skip
    assert bucket_for(101, buckets) is None
    # The default buckets end at the contract's batch bound, so every call has one.
    assert max(GRAPH_BATCH_SIZES) == MAX_BATCH
    assert all(bucket_for(rows, GRAPH_BATCH_SIZES) for rows in range(1, MAX_BATCH + 1))


def test_prompts_are_padded_on_the_left_and_filler_rows_added() -> None:
    ids, valid = left_padded([[1, 2, 3], [4], [5, 6]], rows=5, pad_token_id=PAD)
    assert ids == [[1, 2, 3], [PAD, PAD, 4], [PAD, 5, 6], [PAD] * 3, [PAD] * 3]
    assert valid == [
        [True, True, True],
        [False, False, True],
        [False, True, True],
        [False, False, True],  # filler: one real position, so no query attends to nothing
        [False, False, True],
    ]


def test_prefill_mask_is_causal_over_real_tokens_and_pad_attends_to_itself() -> None:
    _, valid = left_padded([[1, 2, 3], [4]], rows=2, pad_token_id=PAD)
    real = torch.tensor(valid)
    mask = prefill_mask(real)
    # Over the prompt's own positions only: the attention cuts the cache to the mask's width.
    assert mask.shape == (2, 1, 3, 3)
    assert mask.dtype == torch.bool
    full = mask[0, 0].int().tolist()
    assert full == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    padded = mask[1, 0].int().tolist()
    # Pad positions see only themselves; the real token sees itself (not the pads before it).
    assert padded == [[1, 0, 0], [0, 1, 0], [0, 0, 1]]
    # No query attends to nothing.
    assert bool(mask.any(dim=-1).all())


def test_chunks_of_steps_double_to_their_bound_and_32_steps_take_7_reads() -> None:
    sizes = chunk_sizes()
    chunks = [next(sizes) for _ in range(7)]
    assert chunks == [1, 2, 4, CHUNK_STEPS, CHUNK_STEPS, CHUNK_STEPS, CHUNK_STEPS]
    # The first token comes from the prefill; the reads of a 32-step call, as _decode makes
    # them: the first token's, then each chunk's.
    sizes, launched, reads = chunk_sizes(), 1, 1
    while launched < 32:
        launched += min(next(sizes), 32 - launched)
        reads += 1
    assert reads == 7


def test_a_call_attends_over_the_narrowest_width_that_holds_it() -> None:
    widths = decode_widths(543)
    assert widths == [*DECODE_WIDTHS, 543]
    assert [bucket_for(n, widths) for n in (1, 64, 65, 200, 256, 257, 543)] == [
        64, 64, 128, 256, 256, 543, 543,
    ]  # fmt: skip
    assert decode_widths(100) == [64, 100]
    assert decode_widths(64) == [64]


def test_positions_count_from_each_prompt_s_first_real_token_as_generate_does() -> None:
    _, valid = left_padded([[1, 2, 3], [4], [5, 6]], rows=3, pad_token_id=PAD)
    real = torch.tensor(valid)
    assert prompt_positions(real).tolist() == [[0, 1, 2], [0, 0, 0], [0, 0, 1]]
    # transformers' own numbering of a left-padded batch (generation's position ids)
    expected = real.long().cumsum(-1) - 1
    expected.masked_fill_(real == 0, 0)
    assert torch.equal(prompt_positions(real), expected)


def test_the_settings_offer_the_sampler_s_modes_and_bound() -> None:
    assert settings.SAMPLING_CUDA_GRAPHS in CUDA_GRAPH_MODES
    # settings.py cannot import the sampler (a web process never imports torch): the default
    # it writes must be the sampler's own.
    assert settings.SAMPLING_CUDA_GRAPH_PROMPT_TOKENS == DEFAULT_PROMPT_TOKENS


def test_a_bad_mode_stops_the_settings_naming_the_sampler_s_modes(tmp_path: Path) -> None:
    refused = manage_check(tmp_path, DJANGO_SECRET_KEY="k" * 50, SAMPLING_CUDA_GRAPHS="always")
    assert refused.returncode != 0
    line = refused.stderr.strip().splitlines()[-1]  # the exception, last
    assert "SAMPLING_CUDA_GRAPHS must be one of" in line
    offered = line.split("one of ")[1].split(";")[0].split(", ")
    assert tuple(offered) == CUDA_GRAPH_MODES
