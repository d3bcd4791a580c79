"""API keys for the integration tests: made as an operator makes them, sent as clients do."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import TypeVar

import openai

from devstack.stack import ROOT, Stack
from tests.support.http import request
from tests.support.waiting import wait_until

T = TypeVar("T")
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
    401): /v1/models checks a key without counting it. Where keys are optional an unknown key
    is served as anonymous, and this would say yes at once."""
    assert stack.environment().get("SAMPLING_REQUIRE_API_KEY") == "1", "keys are optional here"
    return all(
        request(stack.base_url, "/v1/models", method="GET", headers=bearer(key)).status == 200
        for _ in range(PROBES)
    )


def once_known(call: Callable[[], T], timeout_s: float = 10.0) -> T:
    """`call()`, made again while it answers 401 for an unknown key: a web process may read a
    new key after others did (the probes above only make it likely that all have), and its
    401 charges nothing."""

    def answered() -> T | None:
        try:
            return call()
        except openai.AuthenticationError:
            return None

    found = wait_until(answered, timeout_s, "an answer from a web process that knows the key")
    assert found is not None
    return found
