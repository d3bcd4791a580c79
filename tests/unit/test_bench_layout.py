"""The benchmarks' layout: one command line that lists them all, each benchmark a module or
package of its own with `add_arguments` and `main`, building on the harness and the project's
packages but never on another benchmark."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from bench.__main__ import BENCHMARKS
from devstack.stack import ROOT
from tests.support.python_source import parse as parse_source

BENCH = ROOT / "bench"
# Packages under bench/ that are not benchmarks: the harness, the baselines' Django project
# (bench compare's alternatives) and the probe a worker loads (bench gap's timed sampler).
SUPPORT = {"harness", "baselines", "shims"}


def benchmark_entry(name: str) -> Path:
    """The benchmark's module, or its package's __init__."""
    module = BENCH / f"{name}.py"
    return module if module.exists() else BENCH / name / "__init__.py"


def imported_modules(path: Path) -> set[str]:
    """Every module the file imports, at its top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(parse_source(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def owner(path: Path) -> str | None:
    """The benchmark a file under bench/ belongs to (None: the harness, the CLI, support)."""
    first = path.relative_to(BENCH).parts[0].removesuffix(".py")
    return first if first in BENCHMARKS else None


def test_every_module_and_package_under_bench_is_a_registered_benchmark_or_support() -> None:
    found = {
        path.name.removesuffix(".py")
        for path in BENCH.iterdir()
        if (path.suffix == ".py" or (path / "__init__.py").exists() or path.is_dir())
        and path.name not in ("__init__.py", "__main__.py", "__pycache__")
    }
    assert found - SUPPORT == set(BENCHMARKS)


def test_every_benchmark_has_a_description_and_its_two_functions() -> None:
    for name in BENCHMARKS:
        tree = parse_source(benchmark_entry(name).read_text())
        docstring = ast.get_docstring(tree)
        assert docstring, name
        functions = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        assert {"add_arguments", "main"} <= functions, name


def test_no_benchmark_imports_another_and_the_harness_imports_none() -> None:
    crossing = []
    for path in sorted(BENCH.rglob("*.py")):
        mine = owner(path)
        if path.name == "__main__.py" and path.parent == BENCH:
            continue  # the CLI imports the one benchmark named, by name
        for module in imported_modules(path):
            parts = module.split(".")
            benchmark = parts[1] if parts[0] == "bench" and len(parts) > 1 else None
            if benchmark in BENCHMARKS and benchmark != mine:
                crossing.append(f"{path.relative_to(ROOT)} imports {module}")
    assert crossing == []


def test_the_command_line_lists_every_benchmark() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "bench", "--help"],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    listed = [line.split()[0] for line in shown.split("benchmarks:\n", 1)[1].splitlines()]
    assert listed == list(BENCHMARKS)


def test_a_benchmark_shows_its_own_options() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "bench", "gap", "--help"],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    assert "usage: python -m bench gap" in shown
    for option in ("--against", "--write-costs", "--rounds", "--scenarios"):
        assert option in shown
