"""The static decoder's attention: grouped-query attention that never copies the KV heads, over
only the cache positions a call holds.

transformers' SDPA path, given an explicit mask (which the static decoder must pass), repeats
each KV head for its query heads (`repeat_kv`) over the cache's whole capacity before the
kernel runs. Here the query heads of one KV head are folded into query positions instead:
[batch, heads, length, dim] becomes [batch, kv heads, groups x length, dim], with the mask
repeated per group (a no-op for a decode step of one token). The keys are cut to the mask's
width, so a call of short prompts attends over its own positions, not the cache's capacity.

It runs only inside `grouped_attention_on` (the static decoder's forwards and captures); any
other mask goes to transformers' own SDPA function unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "sampling_grouped_sdpa"


def grouped_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: (output [batch, length, heads, dim], no weights)."""
    if (
        attention_mask is None
        or attention_mask.dim() != 4
        or attention_mask.dtype != torch.bool
        or kwargs.get("position_bias") is not None
        or kwargs.get("cache") is not None
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    width = attention_mask.shape[-1]
    key, value = key[:, :, :width], value[:, :, :width]
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, length, dim = query.shape
    mask = attention_mask
    if groups > 1:
        # Query head h reads KV head h // groups (repeat_kv's order).
        query = query.reshape(batch, heads // groups, groups * length, dim)
        if length > 1:
            rows = mask.shape[0]
            mask = mask[:, :, None].expand(rows, 1, groups, length, width)
            mask = mask.reshape(rows, 1, groups * length, width)
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )
    output = output.reshape(batch, heads, length, value.shape[-1]).transpose(1, 2)
    return output.contiguous(), None


AttentionInterface.register(NAME, grouped_attention)
# The mask code looks its function up by the same name (a 4D mask passes through it untouched).
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


@contextmanager
def grouped_attention_on(model: Any) -> Iterator[None]:
    """`model`'s attention layers use `grouped_attention` inside the block (a captured graph
    keeps it after)."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before
