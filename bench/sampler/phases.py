"""Where a static-decoder call's time goes (bench.sampler --parts phases,fusednorm): the call
cut into its phases, each timed to the device's end, and the same calls with every RMSNorm
as one fused kernel (torch's `rms_norm`), the captured graphs rebuilt for it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from bench.harness.report import markdown_table
from bench.sampler.timing import median_call, shown
from workers.samplers.hf import HFSampler

PHASES = ("tokenize", "prefill", "choose", "steps", "text")


@contextmanager
def timed_phases(sampler: HFSampler, spent: dict[str, float]) -> Iterator[None]:
    """Wraps the call's phases in timers that wait for the device at each phase's end (the
    steps then lose the overlap of reads and replays, so the sum exceeds a plain call).
    Without graphs each step runs `_choose` too: "choose" then counts every step's choice."""
    import torch

    decoder = sampler.decoder
    assert decoder is not None
    cuda = sampler.device.startswith("cuda")
    wrapped: list[tuple[Any, str]] = []

    def wrap(owner: Any, name: str, phase: str) -> None:
        original = getattr(owner, name)
        wrapped.append((owner, name))

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            result = original(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize(sampler.device)
            spent[phase] = spent.get(phase, 0.0) + time.perf_counter() - started
            return result

        setattr(owner, name, timed)

    wrap(sampler, "_token_ids", "tokenize")
    wrap(decoder, "_prefill", "prefill")
    wrap(decoder, "_choose", "choose")
    wrap(decoder, "_decode", "steps")
    wrap(sampler.tokenizer, "decode", "text")
    try:
        yield
    finally:
        for owner, name in wrapped:
            delattr(owner, name)  # the instance's wrapper goes; the class's method shows again


def phases_table(
    sampler: HFSampler, prompts: list[str], sizes: list[int], new_tokens: int, repeats: int
) -> str:
    """Per batch size: the plain call, then each phase's median (ms)."""
    if sampler.decoder is None:  # no graphs here (a CPU): time the static path's steps
        sampler.use_static_cache(graphs=False)
    header = ["batch size", "call", *PHASES, "per step"]
    rows = []
    for size in sizes:
        call = partial(sampler.batched_sample, prompts[:size])
        plain = median_call(sampler, call, repeats)
        runs: list[dict[str, float]] = []
        for _ in range(repeats):
            spent: dict[str, float] = {}
            with timed_phases(sampler, spent):
                call()
            runs.append(spent)
        middle = sorted(runs, key=lambda spent: sum(spent.values()))[len(runs) // 2]
        steps = max(new_tokens - 1, 1)
        cells = [shown(middle.get(phase, 0.0)) for phase in PHASES]
        rows.append([str(size), shown(plain), *cells, shown(middle.get("steps", 0.0) / steps)])
    return markdown_table(header, rows, align="r" * len(header))


def fused_norm_table(
    sampler: HFSampler, prompts: list[str], sizes: list[int], new_tokens: int, repeats: int
) -> str:
    """The calls with HF's RMSNorm (about seven kernels) against torch's fused `rms_norm`
    (one), graphs recaptured for each; and how many greedy answers the fusion changes."""
    import torch

    if sampler.decoder is None:  # no graphs here (a CPU): time the static path's steps
        sampler.use_static_cache(graphs=False)
    assert sampler.decoder is not None
    graphs = sampler.decoder.graphs
    before = {size: median_call(sampler, partial(sampler.batched_sample, prompts[:size]),
                                repeats) for size in sizes}  # fmt: skip
    answers = sampler.batched_sample(prompts[: max(sizes)])
    with fused_norms(sampler.model, torch):
        sampler.use_static_cache(graphs)
        after = {size: median_call(sampler, partial(sampler.batched_sample, prompts[:size]),
                                   repeats) for size in sizes}  # fmt: skip
        fused_answers = sampler.batched_sample(prompts[: max(sizes)])
    sampler.use_static_cache(graphs)
    changed = sum(a != b for a, b in zip(answers, fused_answers, strict=True))
    header = ["batch size", "HF RMSNorm: call", "fused rms_norm: call", "speed-up"]
    rows = [
        [str(size), shown(before[size]), shown(after[size]), f"{before[size] / after[size]:.2f}x"]
        for size in sizes
    ]
    table = markdown_table(header, rows, align="rrrr")
    return f"{table}\n\ngreedy answers the fusion changed: {changed} of {len(answers)}"


@contextmanager
def fused_norms(model: Any, torch: Any) -> Iterator[None]:
    """Every `*RMSNorm` module of `model` runs torch's fused `rms_norm` while inside."""
    patched = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    for module in patched:
        module.forward = _fused_forward(module, torch)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


def _fused_forward(module: Any, torch: Any) -> Callable[[Any], Any]:
    shape = (module.weight.shape[-1],)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))

    def forward(hidden: Any) -> Any:
        return torch.nn.functional.rms_norm(hidden, shape, module.weight, eps)

    return forward
