"""Tests wait for conditions, not for time: fixed delays are few, and each that stands for a
duration (a slow sampler, an outage's length) says so with a `# duration` comment."""

from __future__ import annotations

import ast
from pathlib import Path

from devstack.stack import ROOT
from tests.support.python_source import parse as parse_source

MAX_FIXED_DELAYS = 15
NO_DELAY_AT_ALL = ("tests/unit/test_aggregator.py", "tests/unit/test_lanes.py")
POLLER = "tests/support/waiting.py"


def delays(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each `sleep(...)` call, and each `x.wait(<number>)` whose result is
    dropped (an Event used as a delay)."""
    source = path.read_text()
    lines = source.splitlines()
    tree = parse_source(source, filename=str(path))
    dropped = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    found = []
    for call in ast.walk(tree):
        if not isinstance(call, ast.Call):
            continue
        function = call.func
        called = function.attr if isinstance(function, ast.Attribute) else ""
        called = called or (function.id if isinstance(function, ast.Name) else "")
        waits_a_number = (
            called == "wait"
            and id(call) in dropped
            and bool(call.args)
            and isinstance(call.args[0], ast.Constant)
        )
        if called == "sleep" or waits_a_number:
            found.append((call.lineno, lines[call.lineno - 1]))
    return found


def all_delays() -> dict[str, list[tuple[int, str]]]:
    return {
        str(path.relative_to(ROOT)): found
        for path in sorted((ROOT / "tests").rglob("*.py"))
        if (found := delays(path))
    }


def test_fixed_delays_are_few_and_the_rest_stand_for_durations() -> None:
    undeclared = [
        f"{name}:{line}"
        for name, found in all_delays().items()
        for line, text in found
        if "# duration" not in text and name != POLLER
    ]
    assert len(undeclared) < MAX_FIXED_DELAYS, undeclared


def test_the_aggregator_and_lane_tests_run_on_a_set_clock() -> None:
    found = all_delays()
    assert [found[name] for name in NO_DELAY_AT_ALL if name in found] == []


def test_a_delay_is_found(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import time\ntime.sleep(1)\nstop.wait(0.5)\nok = done.wait(2)\n")
    assert [line for line, _ in delays(sample)] == [2, 3]
