"""The sampler benchmark's models and prompts: the packaged model or a SmolLM2 architecture
with random weights, prompts of mixed lengths, and one batch size's timed calls
(bench.sampler)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from workers.samplers.base import GenerationSettings
from workers.samplers.hf import HFSampler
from workers.samplers.hf_source import choose_device, choose_dtype, load_tokenizer, resolve_model

SUBJECTS = ["the moon", "a river", "Paris", "the number seven", "an old clock", "winter"]
PASSAGE = (
    "The river rose in the night, and by morning the old mill stood in water to its windows. "
    "Nobody in the village could remember a flood like it, though the oldest of them spoke of "
    "a winter when the ice broke the bridge and the ferry carried the mail for a month. "
    "The miller walked along the bank with his dog, counting the sacks that floated past, "
    "and wondered whether the insurance would cover grain that had already been sold. "
)

# The SmolLM2 architectures (their published configs), built with random weights: a decode
# step's time depends on the shapes, not on the weights' values.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
    ),
    "smollm2-360m": dict(
        hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
        num_attention_heads=15, num_key_value_heads=5, rope_theta=100000.0,
    ),
    "smollm2-1.7b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
        num_attention_heads=32, num_key_value_heads=32, rope_theta=130000.0,
    ),
}  # fmt: skip


def prompts_for(size: int) -> list[str]:
    """Distinct prompts, 4 to 20 words, so each batch is padded."""
    return [
        f"Prompt {i}: write one sentence about {SUBJECTS[i % len(SUBJECTS)]}"
        + " and why it matters" * (i % 4)
        for i in range(size)
    ]


def prompts_of_tokens(
    size: int, shortest: int, longest: int, count: Callable[[str], int]
) -> list[str]:
    """Distinct prompts whose token counts spread evenly from `shortest` to `longest`."""
    words = (PASSAGE * (1 + longest // 40)).split()
    prompts = []
    for i in range(size):
        target = shortest + (longest - shortest) * i // max(size - 1, 1)
        text = f"{i}:"
        for word in words:
            if count(f"{text} {word}") > target:
                break
            text = f"{text} {word}"
        prompts.append(text)
    return prompts


def random_weights(arch: str, tokenizer: Any, device: str, dtype: Any) -> Any:
    """The architecture's model with random weights, made on the device."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **ARCHITECTURES[arch],
    )
    torch.manual_seed(0)
    with torch.device(device):  # made in its dtype: a cast would take the rotary buffers too
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def load(args: argparse.Namespace, max_new_tokens: int) -> HFSampler:
    generation = GenerationSettings(max_new_tokens=max_new_tokens)
    on_gpu = choose_device(args.device).startswith("cuda")
    # "on" insists on the graphs only where there can be some; a CPU times its static path.
    graphs = {"off": "off", "on": "on" if on_gpu else "auto"}.get(args.graphs, "auto")
    if not args.arch:
        return HFSampler(args.model, generation, args.device, cuda_graphs=graphs)
    tokenizer = load_tokenizer(resolve_model(""))  # the packaged SmolLM2's
    device = choose_device(args.device)
    network = random_weights(args.arch, tokenizer, device, choose_dtype(device))
    label = f"{args.arch} (random weights)"
    return HFSampler(label, generation, device, cuda_graphs=graphs, preloaded=(tokenizer, network))


def time_calls(sampler: HFSampler, prompts: list[str], repeats: int) -> tuple[float, float]:
    """The median wall time of a call (s), and the GPU memory in use at most meanwhile (MiB;
    0 on a CPU)."""
    import torch

    cuda = sampler.device.startswith("cuda")
    sampler.batched_sample(prompts)  # warm-up for this shape
    if cuda:
        torch.cuda.synchronize(sampler.device)
        torch.cuda.reset_peak_memory_stats(sampler.device)
    durations = []
    for _ in range(repeats):
        started = time.perf_counter()
        completions = sampler.batched_sample(prompts)
        if cuda:
            torch.cuda.synchronize(sampler.device)
        durations.append(time.perf_counter() - started)
        if len(completions) != len(prompts):
            raise SystemExit(f"{len(completions)} completions for {len(prompts)} prompts")
    memory = torch.cuda.max_memory_allocated(sampler.device) / 2**20 if cuda else 0.0
    return statistics.median(durations), memory
