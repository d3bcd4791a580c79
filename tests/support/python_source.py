"""A Python file's syntax tree for the tests that read the code, past CPython 3.11's spurious
"AST constructor recursion depth mismatch" (gh-106905): its counter can be left off by another
thread, and the same parse succeeds at once when repeated."""

from __future__ import annotations

import ast
from pathlib import Path

ATTEMPTS = 3


def parse(source: str | Path, filename: str = "<unknown>") -> ast.Module:
    text = source.read_text() if isinstance(source, Path) else source
    for attempt in range(ATTEMPTS):
        try:
            return ast.parse(text, filename=filename)
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc) or attempt == ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")
