"""API keys for the integration tests: made as an operator makes them, sent as clients do."""

from __future__ import annotations

import os
import subprocess
import sys

from inference_site.lib.stack import ROOT, Stack


def create_key(stack: Stack, name: str, *options: str) -> str:
    """`manage.py createapikey`, as an operator runs it: the key is stdout's last line."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "createapikey", name, *options],
        env={**os.environ, **stack.environment()}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout.strip().splitlines()[-1]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
