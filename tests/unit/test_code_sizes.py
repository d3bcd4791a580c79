"""Modules and functions stay small enough to read in one sitting (tests and migrations aside)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from devstack.stack import ROOT
from tests.support.python_source import parse as parse_source

PACKAGES = (
    "config", "batching", "accounts", "telemetry", "serving", "workers", "operations",
    "offline", "planning", "inference_site", "devstack", "bench",
)  # fmt: skip
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_AGGREGATOR_LINES = 450
MAX_BENCHMARK_LINES = 250

LUA_LINE = re.compile(
    r"^\s*(local \w+ = |local function |if .+ then|for .+ do$|end$|return redis\.)", re.MULTILINE
)


def sources() -> list[Path]:
    return sorted(
        path
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if "migrations" not in path.parts
    )


def name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def long_functions(path: Path) -> list[str]:
    tree = parse_source(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{name(path)}:{node.name} ({length} lines)")
    return found


def test_no_module_is_over_its_line_bound() -> None:
    too_long = []
    for path in sources():
        lines = len(path.read_text().splitlines())
        bound = MAX_AGGREGATOR_LINES if name(path) == "batching/aggregator.py" else MAX_MODULE_LINES
        if lines > bound:
            too_long.append(f"{name(path)} ({lines} lines)")
    assert too_long == []


def test_no_benchmark_module_is_over_its_line_bound() -> None:
    too_long = [
        f"{name(path)} ({lines} lines)"
        for path in sorted((ROOT / "bench").rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) > MAX_BENCHMARK_LINES
    ]
    assert too_long == []


def test_no_function_is_over_its_line_bound() -> None:
    too_long = [found for path in sources() for found in long_functions(path)]
    assert too_long == []


def lua_strings(path: Path) -> int:
    """String literals of the module that read as Lua (two lines or more of its keywords)."""
    tree = parse_source(path.read_text(), filename=str(path))
    pieces = [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ] + [
        "".join(str(part.value) for part in node.values if isinstance(part, ast.Constant))
        for node in ast.walk(tree)
        if isinstance(node, ast.JoinedStr)
    ]
    return sum(1 for piece in pieces if len(LUA_LINE.findall(piece)) >= 2)


def test_no_lua_lives_inside_python() -> None:
    with_lua = [name(path) for path in sources() if lua_strings(path)]
    assert with_lua == []
