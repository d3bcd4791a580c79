"""The rooms' rules that a machine checks beyond import-linter's contracts (pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

from devstack.stack import ROOT

PACKAGES = (
    "config", "batching", "accounts", "telemetry", "serving", "workers", "operations",
    "offline", "planning", "inference_site", "devstack", "bench",
)  # fmt: skip


def strongly_connected(graph: grimp.ImportGraph) -> list[set[str]]:
    """Tarjan's strongly connected components of more than one module: the import cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[set[str]] = []
    counter = 0

    def visit(module: str) -> None:
        nonlocal counter
        index[module] = low[module] = counter
        counter += 1
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(component)

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def test_no_import_cycle_counting_imports_inside_functions() -> None:
    sys.setrecursionlimit(10_000)
    graph = grimp.build_graph(*PACKAGES)
    # grimp reads every import statement, a function's too: the graph has this one.
    assert "serving.runtime" in graph.find_modules_directly_imported_by("operations.apps")
    assert strongly_connected(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for module in ("a", "b", "c"):
        graph.add_module(module)
    graph.add_import(importer="a", imported="b")
    graph.add_import(importer="b", imported="a")
    graph.add_import(importer="b", imported="c")
    assert strongly_connected(graph) == [{"a", "b"}]


def test_the_import_contracts_hold() -> None:
    linted = subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert linted.returncode == 0, linted.stdout[-3000:] + linted.stderr[-2000:]
    assert "0 broken" in linted.stdout


def test_the_project_stands_on_its_own() -> None:
    """Nothing in the repository points at notes outside it."""
    outside = "../" + "shared"
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    offenders = []
    for name in tracked:
        path = ROOT / name
        if not path.is_file() or path.stat().st_size > 1_000_000:
            continue
        try:
            text = Path(path).read_text()
        except UnicodeDecodeError:
            continue
        if outside in text:
            offenders.append(name)
    assert offenders == []
