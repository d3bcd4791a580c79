"""Every dotted reference to the project's code in a docstring (`batching.keys`,
`workers.samplers.rows.RowEnds`) names a module, package or top-level name that exists: a
docstring that names a moved module misleads its reader."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

from tests.support.python_source import parse as parse_source

ROOT = Path(__file__).resolve().parents[2]
NOT_CODE = {"tests", "docs", "node_modules"}


def packages() -> list[str]:
    """The top-level folders that hold the project's Python code."""
    return sorted(
        path.name
        for path in ROOT.iterdir()
        if path.is_dir()
        and not path.name.startswith(".")
        and path.name not in NOT_CODE
        and any(path.glob("*.py"))
    )


def sources() -> list[Path]:
    tops = set(packages())
    return sorted(path for path in ROOT.rglob("*.py")
                  if path.relative_to(ROOT).parts[0] in tops)  # fmt: skip


@cache
def top_level_names(path: Path) -> frozenset[str]:
    names: set[str] = set()
    for node in parse_source(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return frozenset(names)


def resolves(reference: str) -> bool:
    """`a.b.c`: a module or package a/b/c, or the name c defined at the top of a/b."""
    parts = reference.split(".")
    for length in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:length])
        rest = parts[length:]
        if not rest and (base.is_dir() or base.with_suffix(".lua").is_file()):
            return True
        module = (
            base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        )
        if module.is_file():
            return not rest or rest[0] in top_level_names(module)
    return False


def references(path: Path, pattern: re.Pattern[str]) -> list[str]:
    found = []
    for node in ast.walk(parse_source(path.read_text())):
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            docstring = ast.get_docstring(node) or ""
            found += [match.rstrip(".") for match in pattern.findall(docstring)]
    return found


def test_every_dotted_reference_in_a_docstring_resolves() -> None:
    tops = packages()
    assert {"batching", "workers"} <= set(tops), tops
    pattern = re.compile(rf"(?<![\w./-])((?:{'|'.join(tops)})(?:\.\w+)+)")
    checked, broken = 0, []
    for path in sources():
        for reference in references(path, pattern):
            checked += 1
            if not resolves(reference):
                broken.append(f"{path.relative_to(ROOT)}: {reference}")
    assert checked > 20, checked  # the scan finds the references there are
    assert not broken, broken


def test_the_check_catches_a_reference_to_a_moved_module() -> None:
    assert resolves("batching.result_store.queue_result")
    assert resolves("workers.samplers")
    assert not resolves("batching.results.queue_result")
    assert not resolves("batching.no_such_module")
