"""A sampled row's draw on the device (workers.samplers.draws): exact 32-bit hashing, Gumbel
noise per (seed, step, token) that no other row changes and that stays finite, draws that
follow the row's own probabilities after temperature and top-p, and draws that the last bits
of a logit do not move."""

from __future__ import annotations

import math
import random

import torch

from workers.samplers.draws import (
    UNIFORM_BITS,
    as_int32,
    chosen_tokens,
    drawn_tokens,
    gumbel_noise,
    mix32,
    seed_key,
)

MASK32 = 0xFFFFFFFF


def lowbias32(value: int) -> int:
    """The hash in plain Python integers: what the tensor version must equal."""
    value ^= value >> 16
    value = (value * 0x7FEB352D) & MASK32
    value ^= value >> 15
    value = (value * 0x846CA68B) & MASK32
    return value ^ (value >> 16)


def keys_of(seeds: range | list[int]) -> torch.Tensor:
    return torch.tensor([[seed_key(seed)] for seed in seeds])


def test_the_hash_is_exact_32_bit_arithmetic() -> None:
    rng = random.Random(5)
    values = [0, 1, MASK32, 0x80000000, 0x7FFFFFFF, *(rng.getrandbits(32) for _ in range(5000))]
    hashed = mix32(as_int32(torch.tensor(values, dtype=torch.long)))
    assert [value & MASK32 for value in hashed.tolist()] == [lowbias32(v) for v in values]


def test_seeds_give_distinct_keys_of_63_bits() -> None:
    seeds = [0, 1, 2, -1, 2**63 - 1, -(2**63), 10**30]
    keys = [seed_key(seed) for seed in seeds]
    assert len(set(keys)) == len(keys)
    assert all(0 <= key < 2**63 for key in keys)
    assert seed_key(7) == seed_key(7)


def test_a_row_s_noise_depends_on_its_key_step_and_token_only() -> None:
    keys, step = keys_of(range(64)), torch.tensor([3])
    together = gumbel_noise(keys, step, 1000)
    alone = torch.cat([gumbel_noise(keys[i : i + 1], step, 1000) for i in range(64)])
    assert torch.equal(together, alone)
    assert not torch.equal(gumbel_noise(keys, torch.tensor([4]), 1000), together)
    # The first 500 tokens' noise does not depend on the vocabulary's size.
    assert torch.equal(gumbel_noise(keys, step, 500), together[:, :500])


def test_the_noise_is_finite_and_gumbel_distributed() -> None:
    noise = gumbel_noise(keys_of(range(200)), torch.tensor([0]), 5000).flatten()
    # Exact ends: u in [2**-24, 1 - 2**-24], never 0 or 1.
    low, high = 2.0 ** -(UNIFORM_BITS + 1), 1 - 2.0 ** -(UNIFORM_BITS + 1)
    assert bool(torch.isfinite(noise).all())
    assert -math.log(-math.log(low)) <= noise.min().item()
    assert noise.max().item() <= -math.log(-math.log(high))
    # A Gumbel's mean is Euler's constant, its variance pi**2 / 6: a million draws.
    assert abs(noise.mean().item() - 0.5772) < 0.01
    assert abs(noise.var().item() - math.pi**2 / 6) < 0.02


def test_draws_follow_the_row_s_probabilities() -> None:
    """20,000 rows (each a seed) drawing from one distribution: each token's share is within
    five standard deviations of its probability."""
    rows = 20_000
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    scores = probs.log().expand(rows, 4).clone()
    ones = torch.ones(rows, 1)
    noise = gumbel_noise(keys_of(range(rows)), torch.tensor([0]), 4)
    tokens = drawn_tokens(scores, ones, ones, noise)
    shares = torch.bincount(tokens, minlength=4).float() / rows
    spread = (probs * (1 - probs) / rows).sqrt()
    assert bool(((shares - probs).abs() < 5 * spread).all()), shares.tolist()


def test_top_p_keeps_the_nucleus_and_temperature_sharpens() -> None:
    rows = 4000
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    scores = probs.log().expand(rows, 4).clone()
    noise = gumbel_noise(keys_of(range(rows)), torch.tensor([0]), 4)
    ones = torch.ones(rows, 1)
    nucleus = drawn_tokens(scores, ones, torch.full((rows, 1), 0.7), noise)
    # 0.5 + 0.25 reaches 0.7: the two most likely tokens only, in their 2:1 ratio.
    assert set(nucleus.tolist()) == {0, 1}
    assert abs((nucleus == 0).float().mean().item() - 2 / 3) < 0.05
    smallest = drawn_tokens(scores, ones, torch.zeros(rows, 1), noise)
    assert set(smallest.tolist()) == {0}  # top-p 0 keeps the most likely token
    cold = drawn_tokens(scores, torch.full((rows, 1), 0.1), ones, noise)
    assert (cold == 0).float().mean().item() > 0.99


def test_the_last_bits_of_a_logit_rarely_move_a_draw() -> None:
    """Another batch's kernels may change a logit by about 1e-5: over 2,000 draws from a
    vocabulary of 20,000 at temperature 2, at most two move. Sorted inverse-CDF sampling,
    where a float32 running total decides, moved 24 of these."""
    torch.manual_seed(0)
    rows, vocabulary = 2000, 20_000
    scores = torch.randn(rows, vocabulary) * 3
    nudged = scores + torch.randn(rows, vocabulary) * 1e-5
    noise = gumbel_noise(keys_of(range(rows)), torch.tensor([0]), vocabulary)
    hot, ones = torch.full((rows, 1), 2.0), torch.ones(rows, 1)
    moved = drawn_tokens(scores, hot, ones, noise) != drawn_tokens(nudged, hot, ones, noise)
    assert moved.sum().item() <= 2


def test_greedy_rows_take_the_argmax_and_a_nan_row_harms_no_other() -> None:
    torch.manual_seed(0)
    scores = torch.randn(6, 50)
    scores[5] = float("nan")
    greedy = torch.tensor([True, False, True, False, True, False])
    ones, nucleus = torch.ones(6, 1), torch.full((6, 1), 0.9)
    keys = keys_of(range(6))
    tokens = chosen_tokens(scores, greedy, ones, nucleus, keys, torch.tensor([0]))
    assert tokens[greedy].tolist() == scores.argmax(dim=-1)[greedy].tolist()
    clean = chosen_tokens(scores[:5], greedy[:5], ones[:5], nucleus[:5], keys[:5],
                          torch.tensor([0]))  # fmt: skip
    assert torch.equal(tokens[:5], clean)
