"""How a sampled row picks its token, as tensor operations that never leave the device.

Gumbel-max: a row's token is the argmax of its scores (after temperature and top-p) plus
Gumbel noise, one number per token. The noise is a hash of the row's seed, the step and the
token id, not a random generator's state. So one batched call draws for every row at once,
inside a captured CUDA graph as well as in eager `generate`, and a seeded row gets the same
tokens whatever shares its call. A difference in the last bits of a logit, which another
batch's kernels may make, changes a draw only where two tokens' noisy scores nearly tie.

The hash is Chris Wellons' lowbias32 on int32 tensors: products wrap modulo 2**32, and the
right shifts are masked so that they act as unsigned ones.
"""

from __future__ import annotations

import hashlib

import torch

# lowbias32's multipliers, the second as the signed int32 of the same bits.
FIRST_MULTIPLIER = 0x7FEB352D
SECOND_MULTIPLIER = 0x846CA68B - (1 << 32)
# Added to the step and to the token ids before they are hashed, so that 0 does not hash a 0.
STEP_SALT = 0x1E3779B9
TOKEN_SALT = 0x2C1B3C6D
# A uniform number keeps 23 bits, so that it and its half-step are exact in float32: it lies
# in [2**-24, 1 - 2**-24], and its Gumbel noise between -2.9 and 16.7.
UNIFORM_BITS = 23


def _shifted(value: torch.Tensor, bits: int) -> torch.Tensor:
    """An unsigned right shift of 32-bit patterns held in int32."""
    return (value >> bits) & ((1 << (32 - bits)) - 1)


def mix32(value: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int32 tensors: a bijection of 32-bit patterns that spreads every input bit
    over the output."""
    value = value ^ _shifted(value, 16)
    value = value * FIRST_MULTIPLIER
    value = value ^ _shifted(value, 15)
    value = value * SECOND_MULTIPLIER
    return value ^ _shifted(value, 16)


def seed_key(seed: int) -> int:
    """A row's 64-bit key from its seed (any integer), kept under 2**63 for an int64 tensor.
    SHA-256, so that nearby seeds give unrelated keys."""
    digest = hashlib.sha256(str(seed).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def as_int32(value: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of int64 values, as the int32 of the same bits."""
    low = value & 0xFFFFFFFF
    return (low - ((low >> 31) << 32)).to(torch.int32)


def step_keys(keys: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Each row's key ([rows, 1], int64) at `step` (a one-element int64 tensor, the row's new
    tokens so far), as int32 [rows, 1]."""
    low, high = as_int32(keys), as_int32(keys >> 32)
    return mix32(mix32(low ^ mix32(as_int32(step + STEP_SALT))) ^ high)


def gumbel_noise(keys: torch.Tensor, step: torch.Tensor, vocabulary: int) -> torch.Tensor:
    """Gumbel noise for every row and token, [rows, vocabulary], float32: -log(-log(u)) with u
    hashed from the row's key, the step and the token id."""
    tokens = torch.arange(vocabulary, dtype=torch.int32, device=keys.device)
    bits = mix32(mix32(tokens + TOKEN_SALT)[None, :] ^ step_keys(keys, step))
    uniform = (_shifted(bits, 32 - UNIFORM_BITS).to(torch.float32) + 0.5) / (1 << UNIFORM_BITS)
    return -torch.log(-torch.log(uniform))


def drawn_tokens(
    scores: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, noise: torch.Tensor
) -> torch.Tensor:
    """Each row's token drawn from its float32 `scores` ([rows, vocabulary]) at its own
    temperature and top-p ([rows, 1] each), with its Gumbel `noise`. Top-p keeps the smallest
    set of most likely tokens whose mass reaches top-p, at least the most likely one; a row
    at top-p 1 keeps every token."""
    logits = scores / temperature
    ordered, order = logits.sort(dim=-1, descending=True)
    probs = ordered.softmax(dim=-1)
    cut = ((probs.cumsum(dim=-1) - probs) > top_p) & (top_p < 1)
    cut = torch.empty_like(cut).scatter_(-1, order, cut)
    return (logits.masked_fill(cut, float("-inf")) + noise).argmax(dim=-1)


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
    noise = gumbel_noise(keys, step, scores.shape[-1])
    drawn = drawn_tokens(scores, temperature, top_p, noise)
    return torch.where(greedy, scores.argmax(dim=-1), drawn)
