"""Time one `batched_sample` call of the transformers sampler at batch sizes 1, 10, 50, 100.

    .venv/bin/python -m bench.sampler                      # the packaged SmolLM2 GGUF, CPU/GPU
    .venv/bin/python -m bench.sampler --model /models/x --max-new-tokens 32 --repeats 5

Prints a markdown table: the median wall time of a call over --repeats calls (after one
warm-up call per size), completions per second, and the throughput gain over batch size 1.
Greedy decoding, distinct prompts of mixed lengths. Not a test: speed is measured here.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

from workers.samplers.base import GenerationSettings
from workers.samplers.hf import HFSampler

SUBJECTS = ["the moon", "a river", "Paris", "the number seven", "an old clock", "winter"]


def prompts_for(size: int) -> list[str]:
    """Distinct prompts, 4 to 20 words, so each batch is padded."""
    return [
        f"Prompt {i}: write one sentence about {SUBJECTS[i % len(SUBJECTS)]}"
        + " and why it matters" * (i % 4)
        for i in range(size)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="SAMPLING_MODEL (default: packaged GGUF)")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--sizes", default="1,10,50,100")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="", help="cpu, cuda:0 (default: GPU if any)")
    args = parser.parse_args()

    import torch

    loaded = time.perf_counter()
    sampler = HFSampler(
        args.model, GenerationSettings(max_new_tokens=args.max_new_tokens), args.device
    )
    load_s = time.perf_counter() - loaded
    device = sampler.device
    if device.startswith("cuda"):
        hardware = torch.cuda.get_device_name(0)
    else:
        cpu = platform.processor() or platform.machine()
        hardware = f"{cpu}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads"
    print(
        f"model {sampler.source.label} on {device} ({str(sampler.dtype).removeprefix('torch.')}, "
        f"{hardware}), {args.max_new_tokens} new tokens, greedy; loaded in {load_s:.1f} s; "
        f"torch {torch.__version__}"
    )
    sizes = [int(s) for s in args.sizes.split(",")]
    lengths = [len(ids) for ids in sampler.tokenizer(prompts_for(max(sizes)))["input_ids"]]
    print(f"prompts of {min(lengths)} to {max(lengths)} tokens\n")
    print("| batch size | call wall time (median) | completions/s | throughput vs batch 1 |")
    print("|---:|---:|---:|---:|")
    base_rate = None
    for size in sizes:
        prompts = prompts_for(size)
        sampler.batched_sample(prompts)  # warm-up for this shape
        durations = []
        for _ in range(args.repeats):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            started = time.perf_counter()
            completions = sampler.batched_sample(prompts)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            durations.append(time.perf_counter() - started)
            if len(completions) != size:
                raise SystemExit(f"{len(completions)} completions for {size} prompts")
        median = statistics.median(durations)
        rate = size / median
        base_rate = base_rate or rate
        print(f"| {size} | {median * 1000:,.0f} ms | {rate:,.1f} | {rate / base_rate:.1f}x |")


if __name__ == "__main__":
    main()
