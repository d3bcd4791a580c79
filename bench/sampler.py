"""Time one `batched_sample` call of the transformers sampler at batch sizes 1, 10, 50, 100.

    .venv/bin/python -m bench.sampler                      # the packaged SmolLM2 GGUF, CPU/GPU
    .venv/bin/python -m bench.sampler --model /models/x --max-new-tokens 32 --repeats 5
    python -m bench.sampler --device cuda --max-new-tokens 16,32 --prompt-tokens 20-200
    python -m bench.sampler --device cuda --arch smollm2-1.7b --max-new-tokens 16,32 \\
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
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

from workers.samplers.base import GenerationSettings
from workers.samplers.hf import HFSampler, choose_device, choose_dtype, packaged_model_path

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
    from transformers import AutoTokenizer

    gguf = packaged_model_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    args = parser.parse_args()
    if args.device == "cuda":
        args.device = "cuda:0"

    import torch

    new_token_counts = [int(n) for n in args.max_new_tokens.split(",")]
    loaded = time.perf_counter()
    sampler = load(args, max(new_token_counts))
    load_s = time.perf_counter() - loaded
    device = sampler.device
    cuda = device.startswith("cuda")
    decoder = original = sampler.decoder
    if decoder is None and not cuda and args.graphs in ("both", "on"):
        # A CPU has no CUDA graphs: the static cache's steps, run eagerly.
        decoder = sampler.static_decoder(graphs=False)
    fast = "graphs" if decoder is not None and decoder.graphs else "static"
    wanted = args.graphs if args.graphs != "auto" else "both" if cuda else "off"
    modes: list[tuple[str, Any]] = []
    if wanted in ("off", "both") or decoder is None:
        modes.append(("eager", None))
    if wanted in ("on", "both") and decoder is not None:
        modes.append((fast, decoder))
    if cuda:
        hardware = torch.cuda.get_device_name(device)
    else:
        cpu = platform.processor() or platform.machine()
        hardware = f"{cpu}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads"
    import transformers

    print(
        f"model {sampler.source.label} on {device} ({str(sampler.dtype).removeprefix('torch.')}, "
        f"{hardware}), greedy; loaded in {load_s:.1f} s; torch {torch.__version__}, "
        f"transformers {transformers.__version__}"
    )
    if cuda:
        graphs = (
            f"CUDA graphs for batches of {', '.join(map(str, sorted(decoder.buckets)))} rows, "
            f"captured in {decoder.ready_s:.1f} s, a {decoder.capacity}-position cache"
            if decoder is not None
            else f"no CUDA graphs (SAMPLING_CUDA_GRAPHS={sampler.cuda_graphs})"
        )
        in_use = torch.cuda.memory_allocated(device) / 2**20
        print(f"{graphs}; GPU memory after load: {in_use:,.0f} MiB")
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

    for new_tokens in new_token_counts:
        sampler.configure(GenerationSettings(max_new_tokens=new_tokens))
        print(f"\n{new_tokens} new tokens\n")
        head = ["batch size"]
        for name, _ in modes:
            prefix = f"{name}: " if len(modes) > 1 else ""
            call = "call" if prefix else "call wall time (median)"
            head += [f"{prefix}{call}", "completions/s", "throughput vs batch 1"]
        if len(modes) > 1:
            head.append(f"{fast} speed-up")
        if cuda:
            head.append("GPU memory (peak)")
        print("| " + " | ".join(head) + " |")
        print("|" + "---:|" * len(head))
        base_rates: dict[str, float] = {}
        for size in sizes:
            cells = [str(size)]
            calls: dict[str, float] = {}
            peak = 0.0
            for name, mode_decoder in modes:
                sampler.decoder = mode_decoder
                median, memory = time_calls(sampler, prompts[:size], args.repeats)
                rate = size / median
                base_rates.setdefault(name, rate)
                calls[name] = median
                peak = max(peak, memory)
                cells += [
                    f"{median * 1000:,.1f} ms" if cuda else f"{median * 1000:,.0f} ms",
                    f"{rate:,.1f}",
                    f"{rate / base_rates[name]:.1f}x",
                ]
            sampler.decoder = original
            if len(modes) > 1:
                cells.append(f"{calls['eager'] / calls[fast]:.2f}x")
            if cuda:
                cells.append(f"{peak:,.0f} MiB")
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
