"""Versions of the code a benchmark measures side by side: this checkout, and an older commit
(`--against REF`) checked out in a git worktree of its own. Only the older tree's server code
runs (its stack's processes start in it); the harness and the benchmark are this tree's."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from devstack.stack import ROOT

T = TypeVar("T")


@dataclass(frozen=True)
class Tree:
    """A version of the code: its name in the report and its root."""

    name: str
    root: Path

    @property
    def is_this(self) -> bool:
        return self.root == ROOT


THIS = Tree("this", ROOT)


@contextmanager
def worktree(ref: str) -> Iterator[Path]:
    """`ref` checked out in a temporary git worktree while the block runs."""
    path = Path(tempfile.mkdtemp(prefix="bench-against-"))
    subprocess.run(
        ["git", "worktree", "add", "--detach", "--quiet", str(path), ref], cwd=ROOT, check=True
    )
    try:
        yield path
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, check=False)
        shutil.rmtree(path, ignore_errors=True)


def trees(resources: contextlib.ExitStack, against: str | None) -> list[Tree]:
    """The older tree first (named by its ref's first 8 characters), then this one; the
    older one's worktree lives as long as `resources`."""
    if not against:
        return [THIS]
    return [Tree(against[:8], resources.enter_context(worktree(against))), THIS]


def in_turn(items: Sequence[T], round_index: int) -> list[T]:
    """`items` in order on even rounds (counted from 0), reversed on odd ones: neither version
    always runs on a machine the other just warmed up (or disturbed)."""
    return list(items) if round_index % 2 == 0 else list(items)[::-1]
