"""Time one `batched_sample` call of the transformers sampler at batch sizes 1, 10, 50, 100.

    .venv/bin/python -m bench sampler                      # the packaged SmolLM2 GGUF, CPU/GPU
    .venv/bin/python -m bench sampler --model /models/x --max-new-tokens 32 --repeats 5
    python -m bench sampler --device cuda --max-new-tokens 16,32 --prompt-tokens 20-200
    python -m bench sampler --device cuda --arch smollm2-1.7b --max-new-tokens 16,32 \\
        --prompt-tokens 20-200                             # its architecture, random weights

Prints a markdown table per number of new tokens: the median wall time of a call over
--repeats calls (after one warm-up call per size), completions per second, and the
throughput gain over batch size 1. On a GPU, eager `generate` and the CUDA graphs
(SAMPLING_CUDA_GRAPHS) side by side, from one load of the model, with the GPU memory in use
during each size's calls. Greedy decoding, distinct prompts of mixed lengths (--prompt-tokens:
spread evenly over a range of tokens). Not a test: speed is measured here.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

from bench.harness.report import markdown_table
from bench.sampler.models import (
    ARCHITECTURES,
    load,
    prompts_for,
    prompts_of_tokens,
    time_calls,
)
from bench.sampler.parts import PARTS, run_part
from workers.samplers.base import GenerationSettings
from workers.samplers.hf import HFSampler

Modes = list[tuple[str, Any]]  # (name, the decoder: None for eager generate)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="", help="SAMPLING_MODEL (default: packaged GGUF)")
    parser.add_argument(
        "--arch", choices=sorted(ARCHITECTURES), help="a SmolLM2 architecture, random weights"
    )
    parser.add_argument("--max-new-tokens", default="8", help="one or more, e.g. 16,32")
    parser.add_argument("--sizes", default="1,10,50,100")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="", help="cpu, cuda, cuda:0 (default: GPU if any)")
    parser.add_argument(
        "--graphs",
        choices=["auto", "both", "on", "off"],
        default="auto",
        help="eager generate against CUDA graphs (both; on a CPU: the static cache's steps run "
        "eagerly), or one of them; auto: both on a GPU, eager on a CPU",
    )
    parser.add_argument(
        "--prompt-tokens", default="", help="MIN-MAX: prompts spread over this many tokens"
    )
    parser.add_argument(
        "--parts",
        default="",
        help=f"instead of eager against graphs, one or more of {','.join(PARTS)}: transformers' "
        "continuous batching beside ours, a mixed batch, a profile of the largest size's step",
    )


def modes_of(sampler: HFSampler, graphs: str) -> tuple[Modes, str]:
    """The modes timed side by side, and the name of the fast one."""
    cuda = sampler.device.startswith("cuda")
    decoder = sampler.decoder
    if decoder is None and not cuda and graphs in ("both", "on"):
        # A CPU has no CUDA graphs: the static cache's steps, run eagerly.
        decoder = sampler.static_decoder(graphs=False)
    fast = "graphs" if decoder is not None and decoder.graphs else "static"
    wanted = graphs if graphs != "auto" else "both" if cuda else "off"
    modes: Modes = []
    if wanted in ("off", "both") or decoder is None:
        modes.append(("eager", None))
    if wanted in ("on", "both") and decoder is not None:
        modes.append((fast, decoder))
    return modes, fast


def describe(sampler: HFSampler, load_s: float) -> None:
    """The model, the hardware and the versions; on a GPU, its graphs and memory."""
    import torch
    import transformers

    device = sampler.device
    if device.startswith("cuda"):
        hardware = torch.cuda.get_device_name(device)
    else:
        cpu = platform.processor() or platform.machine()
        hardware = f"{cpu}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads"
    print(
        f"model {sampler.source.label} on {device} ({str(sampler.dtype).removeprefix('torch.')}, "
        f"{hardware}), greedy; loaded in {load_s:.1f} s; torch {torch.__version__}, "
        f"transformers {transformers.__version__}"
    )
    if device.startswith("cuda"):
        decoder = sampler.decoder
        graphs = (
            f"CUDA graphs for batches of {', '.join(map(str, sorted(decoder.buckets)))} rows, "
            f"captured in {decoder.ready_s:.1f} s, a {decoder.capacity}-position cache"
            if decoder is not None
            else f"no CUDA graphs (SAMPLING_CUDA_GRAPHS={sampler.cuda_graphs})"
        )
        in_use = torch.cuda.memory_allocated(device) / 2**20
        print(f"{graphs}; GPU memory after load: {in_use:,.0f} MiB")


def size_table(
    sampler: HFSampler, prompts: list[str], sizes: list[int], modes: Modes, fast: str,
    repeats: int,
) -> str:  # fmt: skip
    """One row per batch size: each mode's median call, rate and gain over batch size 1."""
    cuda = sampler.device.startswith("cuda")
    original = sampler.decoder
    header = ["batch size"]
    for name, _ in modes:
        prefix = f"{name}: " if len(modes) > 1 else ""
        call = "call" if prefix else "call wall time (median)"
        header += [f"{prefix}{call}", "completions/s", "throughput vs batch 1"]
    header += [f"{fast} speed-up"] if len(modes) > 1 else []
    header += ["GPU memory (peak)"] if cuda else []
    rows: list[list[str]] = []
    base_rates: dict[str, float] = {}
    for size in sizes:
        cells, calls, peak = [str(size)], {}, 0.0
        for name, mode_decoder in modes:
            sampler.decoder = mode_decoder
            median, memory = time_calls(sampler, prompts[:size], repeats)
            rate = size / median
            base_rates.setdefault(name, rate)
            calls[name], peak = median, max(peak, memory)
            shown = f"{median * 1000:,.1f} ms" if cuda else f"{median * 1000:,.0f} ms"
            cells += [shown, f"{rate:,.1f}", f"{rate / base_rates[name]:.1f}x"]
        sampler.decoder = original
        cells += [f"{calls['eager'] / calls[fast]:.2f}x"] if len(modes) > 1 else []
        cells += [f"{peak:,.0f} MiB"] if cuda else []
        rows.append(cells)
    return markdown_table(header, rows, align="r" * len(header))


def main(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        args.device = "cuda:0"
    new_token_counts = [int(n) for n in args.max_new_tokens.split(",")]
    loaded = time.perf_counter()
    sampler = load(args, max(new_token_counts))
    describe(sampler, time.perf_counter() - loaded)
    modes, fast = modes_of(sampler, args.graphs)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.prompt_tokens:
        shortest, _, longest = args.prompt_tokens.partition("-")
        prompts = prompts_of_tokens(
            max(sizes), int(shortest), int(longest or shortest), sampler.count_tokens
        )
    else:
        prompts = prompts_for(max(sizes))
    lengths = [len(ids) for ids in sampler.tokenizer(prompts)["input_ids"]]
    print(f"prompts of {min(lengths)} to {max(lengths)} tokens")
    parts = [part for part in args.parts.split(",") if part]
    if unknown := set(parts) - set(PARTS):
        raise SystemExit(f"unknown parts {sorted(unknown)}: choose from {', '.join(PARTS)}")
    for new_tokens in new_token_counts:
        sampler.configure(GenerationSettings(max_new_tokens=new_tokens))
        print(f"\n{new_tokens} new tokens\n")
        if not parts:
            print(size_table(sampler, prompts, sizes, modes, fast, args.repeats))
        for part in parts:
            print(run_part(part, sampler, prompts, sizes, new_tokens, args.repeats), "\n")
