"""The sampler benchmark's timer: a call's median wall time, the device idle at each end."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from workers.samplers.hf import HFSampler


def median_call(sampler: HFSampler, call: Callable[[], Any], repeats: int) -> float:
    """The median wall time of `call` (s), after one warm-up call, the device idle at each
    end."""
    import torch

    cuda = sampler.device.startswith("cuda")
    call()
    durations = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(sampler.device)
        started = time.perf_counter()
        call()
        if cuda:
            torch.cuda.synchronize(sampler.device)
        durations.append(time.perf_counter() - started)
    return statistics.median(durations)


def shown(seconds: float) -> str:
    return f"{seconds * 1000:,.1f} ms"
