"""The rooms as a real gunicorn process sees them: serving /sample loads the request path and
the core, never the GPU workers' runtime or a model library."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from devstack.stack import Stack
from tests.support.http import sample
from tests.support.waiting import wait_until
from workers.samplers.simulated import expected_completion

pytestmark = pytest.mark.integration

SUPPORT = Path(__file__).resolve().parents[1] / "support"


def test_a_web_process_serving_sample_never_imports_the_workers(
    start_stack: Callable[..., Stack], tmp_path: Path
) -> None:
    stack = start_stack(
        "rooms",
        env={"SAMPLER": "simulated", "MODULES_DUMP_DIR": str(tmp_path)},
        web_config=SUPPORT / "gunicorn_modules_conf.py",
    )
    reply = sample(stack.base_url, "E equals ")
    assert (reply.status, reply.body) == (200, expected_completion("E equals "))
    # The hook runs after the answer is sent: give it a moment.
    dumps = wait_until(lambda: list(tmp_path.glob("*.txt")), 5, "the gunicorn hook's module list")
    modules = set(dumps[0].read_text().split())
    # The list is the process's: it holds the request path that just answered.
    assert {"serving.views", "batching.aggregator", "batching.results"} <= modules
    for forbidden in ("workers", "torch", "transformers"):
        loaded = sorted(m for m in modules if m == forbidden or m.startswith(forbidden + "."))
        assert not loaded, f"a web process imported {loaded}"
