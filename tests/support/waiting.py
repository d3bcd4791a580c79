"""Tests wait for a condition, never for a fixed time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.02


def wait_until(condition: Callable[[], T], timeout_s: float = 10.0, what: str = "") -> T:
    """`condition()`'s first truthy value, polled every 20 ms; AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout_s} s: {what or condition!r}")
        time.sleep(POLL_S)
