"""The machine a benchmark ran on, in one line for its report."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path


def describe_machine() -> str:
    model = platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}"
