"""API keys for the integration tests: made as an operator makes them, sent as clients do."""

from __future__ import annotations

import os
import subprocess
import sys

from inference_site.lib.stack import ROOT, Stack
from tests.support.http import request

# Probes of a freshly published key: enough that each of 4 web processes answers some of
# them (8 missed one process 1 time in 10 when one was slow to read the keys).
PROBES = 32


def create_key(stack: Stack, name: str, *options: str) -> str:
    """`manage.py createapikey`, as an operator runs it: the key is stdout's last line."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "createapikey", name, *options],
        env={**os.environ, **stack.environment()}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout.strip().splitlines()[-1]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def known_everywhere(stack: Stack, key: str) -> bool:
    """Every web process knows the key, on a stack that requires keys (an unknown one gets
    401): /v1/models checks a key without counting it."""
    return all(
        request(stack.base_url, "/v1/models", method="GET", headers=bearer(key)).status == 200
        for _ in range(PROBES)
    )
