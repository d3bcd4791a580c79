"""The sampler benchmark's other parts (bench.sampler --parts): transformers' continuous
batching beside our static decoder on the same prompts, a mixed batch as the API sends it,
and a profile of one decode step."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from batching.generation import Completion, Row, RowSettings
from bench.harness.report import markdown_table
from bench.sampler.phases import fused_norm_table, phases_table
from bench.sampler.timing import median_call, shown
from workers.samplers.hf import HFSampler
from workers.samplers.static_decode import bucket_for

PARTS = ("continuous", "mixed", "profile", "phases", "fusednorm")
# Steps profiled, after as many run unprofiled.
PROFILED_STEPS = 8


def run_part(
    part: str, sampler: HFSampler, prompts: list[str], sizes: list[int], new_tokens: int,
    repeats: int,
) -> str:  # fmt: skip
    """One part's table, or the error that stopped it: a failing part on a short device loan
    must not cost the parts after it."""
    import traceback

    try:
        if part == "continuous":
            return continuous_table(sampler, prompts, sizes, new_tokens, repeats)
        if part == "mixed":
            return mixed_table(sampler, prompts, sizes, new_tokens, repeats)
        if part == "phases":
            return phases_table(sampler, prompts, sizes, new_tokens, repeats)
        if part == "fusednorm":
            return fused_norm_table(sampler, prompts, sizes, new_tokens, repeats)
        return profile_step(sampler, prompts, max(sizes), new_tokens)
    except Exception:  # noqa: BLE001  # reported in the table's place, the run goes on
        return f"part {part} failed:\n\n```\n{traceback.format_exc()}```"


def continuous_table(
    sampler: HFSampler, prompts: list[str], sizes: list[int], new_tokens: int, repeats: int
) -> str:
    """Our call against transformers' `generate_batch` (continuous batching on a paged cache),
    greedy, the same prompts and max new tokens, ends of sequence on for both."""
    from transformers import GenerationConfig

    ids = sampler.tokenizer(prompts)["input_ids"]
    config = GenerationConfig(
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=sampler.model.generation_config.eos_token_id,
        pad_token_id=sampler.tokenizer.pad_token_id,
    )
    options: dict[str, Any] = {"progress_bar": False}
    if "warmup" in inspect.signature(sampler.model.generate_batch).parameters:
        options["warmup"] = False  # the timed calls are warmed up here, as ours are
    ours = "graphs" if sampler.decoder is not None and sampler.decoder.graphs else "ours"
    header = ["batch size", f"{ours}: call", "continuous batching: call", "ours vs theirs"]
    rows = []
    for size in sizes:
        mine = median_call(sampler, partial(sampler.batched_sample, prompts[:size]), repeats)
        theirs = median_call(
            sampler,
            partial(sampler.model.generate_batch, inputs=ids[:size], generation_config=config,
                    **options),
            repeats,
        )  # fmt: skip
        rows.append([str(size), shown(mine), shown(theirs), f"{theirs / mine:.2f}x"])
    return markdown_table(header, rows, align="rrrr")


def mixed_rows(prompts: list[str], size: int, new_tokens: int) -> list[Row]:
    """Half sampled with seeds, a quarter with stop strings, a quarter streaming."""
    rows = []
    for i, prompt in enumerate(prompts[:size]):
        settings = RowSettings(max_tokens=new_tokens)
        if i % 2:
            settings = RowSettings(max_tokens=new_tokens, temperature=0.8, top_p=0.95, seed=i)
        if i % 4 == 0:
            settings = RowSettings(max_tokens=new_tokens, stop=(".", "\n"))
        rows.append(Row(prompt, settings, stream=i % 4 == 2))
    return rows


def mixed_table(
    sampler: HFSampler, prompts: list[str], sizes: list[int], new_tokens: int, repeats: int
) -> str:
    """A mixed batch's call, streams sent to a sink that keeps them, against a greedy call of
    the same prompts."""
    header = ["batch size", "greedy: call", "mixed: call", "mixed vs greedy", "streamed pieces"]
    rows = []
    for size in sizes:
        batch = mixed_rows(prompts, size, new_tokens)
        sink = PieceCounter()
        greedy = median_call(sampler, partial(sampler.batched_sample, prompts[:size]), repeats)
        mixed = median_call(sampler, partial(sampler.batched_complete, batch, sink), repeats)
        answers = sampler.batched_complete(batch)
        if not all(isinstance(answer, Completion) for answer in answers):
            raise RuntimeError("a row of the mixed batch was refused")
        count = sink.pieces // (repeats + 1)
        rows.append([str(size), shown(greedy), shown(mixed), f"{mixed / greedy:.2f}x", str(count)])
    return markdown_table(header, rows, align="rrrrr")


class PieceCounter:
    """A stream sink whose clients never leave: counts the pieces of text sent."""

    def __init__(self) -> None:
        self.pieces = 0

    def __call__(self, row: int, text: str, tokens: tuple[int, int] | None = None) -> bool:
        self.pieces += 1
        return False


def profile_step(sampler: HFSampler, prompts: list[str], size: int, new_tokens: int) -> str:
    """One `size`-row step of the static decoder: its replayed and eager times, and the
    kernels of the eager step (a replay runs the same kernels) by device time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from workers.samplers.attention import grouped_attention_on

    decoder = sampler.decoder or sampler.static_decoder(graphs=False)
    rows = bucket_for(size, list(decoder.buckets))
    if rows is None:
        raise SystemExit(f"no bucket holds {size} rows")
    bucket = decoder.buckets[rows]
    ids = sampler.tokenizer(prompts[:size])["input_ids"]
    width = bucket_for(max(map(len, ids)) + new_tokens - 1, decoder.widths)
    assert width is not None
    cuda = sampler.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def steps(count: int, run: Callable[[], Any]) -> float:
        """The mean time of one of `count` steps, from a fresh prefill (s)."""
        decoder._choose(bucket, decoder._prefill(bucket, ids), sampled=False)
        if cuda:
            torch.cuda.synchronize(sampler.device)
        started = time.perf_counter()
        for _ in range(count):
            run()
        if cuda:
            torch.cuda.synchronize(sampler.device)
        return (time.perf_counter() - started) / count

    count = min(PROFILED_STEPS, new_tokens - 1)
    with torch.inference_mode(), grouped_attention_on(sampler.model):
        replayed = steps(count, lambda: decoder._step(bucket, width, False))
        eager = steps(count, lambda: decoder._forward_and_choose(bucket, width, False))
        with profile(activities=activities) as profiler:
            steps(count, lambda: decoder._forward_and_choose(bucket, width, False))
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = profiler.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=60)
    kind = "replayed" if bucket.graphs else "its static path's steps, run eagerly"
    return (
        f"one {size}-row step ({rows}-row bucket, {width}-position width), mean of {count}: "
        f"{kind} {shown(replayed)}, eager {shown(eager)}\n\n```\n{table}```"
    )
