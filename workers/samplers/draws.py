"""How a sampled row picks its token, as tensor operations that never leave the device.

A row's draw depends only on its own scores, its settings, its seed and the step, never on the
rows beside it or on a random generator's state: each (seed, step) pair hashes to one uniform
number, and the token is where that number falls in the row's cumulative probabilities
(inverse-CDF sampling, after temperature and top-p). So one batched call draws for every row
at once, inside a captured CUDA graph as well as in eager `generate`, and a seeded row gets the
same tokens whatever shares its call.

The hash is Chris Wellons' lowbias32 on 32-bit values held in int64 tensors, with every
product kept under 2**63 (torch has no unsigned 32-bit arithmetic on every device).
"""

from __future__ import annotations

import hashlib

import torch

MASK32 = 0xFFFFFFFF
# Added to the step before it is hashed, so that step 0 does not hash a zero.
STEP_SALT = 0x9E3779B9
# A draw's uniform number keeps 24 bits: float32's mantissa.
UNIFORM_BITS = 24


def _times(value: torch.Tensor, constant: int) -> torch.Tensor:
    """(value * constant) mod 2**32 for values under 2**32, in two 16-bit halves of the
    constant so that no product reaches 2**63."""
    low, high = constant & 0xFFFF, constant >> 16
    return (value * low + (((value * high) & 0xFFFF) << 16)) & MASK32


def mix32(value: torch.Tensor) -> torch.Tensor:
    """lowbias32: a bijection of 32-bit values that spreads every input bit over the output."""
    value = value ^ (value >> 16)
    value = _times(value, 0x7FEB352D)
    value = value ^ (value >> 15)
    value = _times(value, 0x846CA68B)
    return value ^ (value >> 16)


def seed_key(seed: int) -> int:
    """A row's 64-bit key from its seed (any integer): two 32-bit halves, hashed again per
    step. SHA-256, so that nearby seeds give unrelated keys."""
    digest = hashlib.sha256(str(seed).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def uniforms(keys: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """One number in (0, 1) for each row's key ([rows, 1], int64) at `step` (a one-element
    int64 tensor, the row's new tokens so far): float32, [rows, 1]."""
    low, high = keys & MASK32, (keys >> 32) & MASK32
    mixed = mix32(low ^ mix32((step + STEP_SALT) & MASK32))
    mixed = mix32(mixed ^ high)
    top = (mixed >> (32 - UNIFORM_BITS)).to(torch.float32)
    return (top + 0.5) / float(1 << UNIFORM_BITS)


def drawn_tokens(
    scores: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, uniform: torch.Tensor
) -> torch.Tensor:
    """Each row's token drawn from its float32 `scores` ([rows, vocabulary]) at its own
    temperature and top-p ([rows, 1] each), where its `uniform` ([rows, 1]) falls in the kept
    tokens' cumulative probability. Top-p keeps the smallest set of most likely tokens whose
    mass reaches top-p, at least the most likely one; a row at top-p 1 keeps every token."""
    ordered, order = (scores / temperature).sort(dim=-1, descending=True)
    probs = ordered.softmax(dim=-1)
    cumulative = probs.cumsum(dim=-1)
    # A prefix of the sorted tokens: the mass before a token only grows.
    kept = ((cumulative - probs) <= top_p) | (top_p >= 1)
    count = kept.sum(dim=-1, keepdim=True)
    mass = cumulative.gather(-1, count - 1)
    index = torch.searchsorted(cumulative, uniform * mass, right=True)
    return order.gather(-1, torch.minimum(index, count - 1)).squeeze(-1)


def chosen_tokens(
    scores: torch.Tensor,
    greedy: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    keys: torch.Tensor,
    step: torch.Tensor,
) -> torch.Tensor:
    """Every row's token of one step: the argmax for a greedy row ([rows] bool), exactly as
    `generate` picks it, and a draw for a sampled one."""
    drawn = drawn_tokens(scores, temperature, top_p, uniforms(keys, step))
    return torch.where(greedy, scores.argmax(dim=-1), drawn)
