"""`manage.py COMMAND` against a stack's database and Redis, as an operator runs it."""

from __future__ import annotations

import os
import subprocess
import sys

from devstack.stack import ROOT, Stack


def manage(stack: Stack, *args: str) -> str:
    """The command's stdout; it must succeed (its stderr is the assertion's message)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), *args],
        env={**os.environ, **stack.environment()}, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout
