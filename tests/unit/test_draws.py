"""A sampled row's draw on the device (workers.samplers.draws): exact 32-bit hashing, a uniform
number per (seed, step) that no other row changes, and draws that follow the row's own
probabilities after temperature and top-p."""

from __future__ import annotations

import random

import torch

from workers.samplers.draws import (
    MASK32,
    chosen_tokens,
    drawn_tokens,
    mix32,
    seed_key,
    uniforms,
)


def lowbias32(value: int) -> int:
    """The hash in plain Python integers: what the tensor version must equal."""
    value ^= value >> 16
    value = (value * 0x7FEB352D) & MASK32
    value ^= value >> 15
    value = (value * 0x846CA68B) & MASK32
    return value ^ (value >> 16)


def test_the_hash_is_exact_32_bit_arithmetic() -> None:
    rng = random.Random(5)
    values = [0, 1, MASK32, 0x80000000, *(rng.getrandbits(32) for _ in range(1000))]
    hashed = mix32(torch.tensor(values, dtype=torch.long)).tolist()
    assert hashed == [lowbias32(value) for value in values]


def test_seeds_give_distinct_keys_of_63_bits() -> None:
    seeds = [0, 1, 2, -1, 2**63 - 1, -(2**63), 10**30]
    keys = [seed_key(seed) for seed in seeds]
    assert len(set(keys)) == len(keys)
    assert all(0 <= key < 2**63 for key in keys)
    assert seed_key(7) == seed_key(7)


def test_a_row_s_uniform_depends_on_its_key_and_step_only() -> None:
    keys = torch.tensor([[seed_key(seed)] for seed in range(64)])
    step = torch.tensor([3])
    together = uniforms(keys, step)
    alone = torch.cat([uniforms(keys[i : i + 1], step) for i in range(64)])
    assert torch.equal(together, alone)
    assert bool(((together > 0) & (together < 1)).all())
    assert len(set(together.flatten().tolist())) == 64
    steps = torch.cat([uniforms(keys[:1], torch.tensor([s])) for s in range(64)])
    assert len(set(steps.flatten().tolist())) == 64


def test_draws_follow_the_row_s_probabilities() -> None:
    """20,000 rows (each a seed) drawing from one distribution: each token's share is within
    five standard deviations of its probability."""
    rows = 20_000
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    scores = probs.log().expand(rows, 4).clone()
    keys = torch.tensor([[seed_key(seed)] for seed in range(rows)])
    ones = torch.ones(rows, 1)
    tokens = drawn_tokens(scores, ones, ones, uniforms(keys, torch.tensor([0])))
    shares = torch.bincount(tokens, minlength=4).float() / rows
    spread = (probs * (1 - probs) / rows).sqrt()
    assert bool(((shares - probs).abs() < 5 * spread).all()), shares.tolist()


def test_top_p_keeps_the_nucleus_and_temperature_sharpens() -> None:
    rows = 4000
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    scores = probs.log().expand(rows, 4).clone()
    keys = torch.tensor([[seed_key(seed)] for seed in range(rows)])
    draw = uniforms(keys, torch.tensor([0]))
    ones = torch.ones(rows, 1)
    nucleus = drawn_tokens(scores, ones, torch.full((rows, 1), 0.7), draw)
    # 0.5 + 0.25 reaches 0.7: the two most likely tokens only, in their 2:1 ratio.
    assert set(nucleus.tolist()) == {0, 1}
    assert abs((nucleus == 0).float().mean().item() - 2 / 3) < 0.05
    smallest = drawn_tokens(scores, ones, torch.zeros(rows, 1), draw)
    assert set(smallest.tolist()) == {0}  # top-p 0 keeps the most likely token
    cold = drawn_tokens(scores, torch.full((rows, 1), 0.1), ones, draw)
    assert (cold == 0).float().mean().item() > 0.99


def test_greedy_rows_take_the_argmax_beside_sampled_ones() -> None:
    torch.manual_seed(0)
    scores = torch.randn(6, 50)
    greedy = torch.tensor([True, False, True, False, True, False])
    keys = torch.tensor([[seed_key(seed)] for seed in range(6)])
    ones = torch.ones(6, 1)
    tokens = chosen_tokens(scores, greedy, ones, ones, keys, torch.tensor([0]))
    assert tokens[greedy].tolist() == scores.argmax(dim=-1)[greedy].tolist()
    again = chosen_tokens(scores, greedy, ones, ones, keys, torch.tensor([0]))
    assert torch.equal(tokens, again)
