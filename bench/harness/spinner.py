"""A slower machine on this one: processes that keep cores busy at normal priority, as other
tenants of a shared host or a noisy neighbour do."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

SPIN = "while True: pass"


@contextmanager
def spinning(cores: int) -> Iterator[None]:
    """`cores` processes, each spinning on a core's worth of CPU, for the block's length."""
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(cores)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
