"""`make run` as a newcomer meets it: with the simulated sampler it starts, answers, and stops
on Ctrl-C without a warning or an error line (a fresh start is not a Redis loss, and the
embedded Redis, out of the terminal's process group, stops last). The pages' examples run in
tests/integration/test_doc_examples.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.http import request
from tests.support.make_run import make_run

pytestmark = pytest.mark.integration

ALARMING = re.compile(r"WARNING|ERROR|CRITICAL|Warning|Traceback|Error\b")


def test_make_run_starts_and_stops_on_ctrl_c_without_a_warning(tmp_path: Path) -> None:
    with make_run(tmp_path) as running:
        answer = request(f"http://127.0.0.1:{running.port}", "/sample", "E equals ")
        assert (answer.status, answer.body) == (200, "MC squared")
        status = running.stop()
    log = running.log.read_text()
    assert "Stopping ..." in log
    assert status in (0, 2, -2)  # make, interrupted: 2 when it reports it, -2 when signalled
    assert [line for line in log.splitlines() if ALARMING.search(line)] == []
