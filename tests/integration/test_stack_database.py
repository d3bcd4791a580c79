"""A benchmark's stack gets a migrated database of its own (Stack.own_database): its web
processes publish that database's keys and policy, not those of the tree's db.sqlite3."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from devstack.stack import ROOT, migrated_database

pytestmark = pytest.mark.integration


def path_of(url: str) -> Path:
    assert url.startswith("sqlite:///"), url
    return Path(url.removeprefix("sqlite:///"))


def test_each_stack_gets_its_own_fully_migrated_copy() -> None:
    first, second = migrated_database(ROOT, os.environ), migrated_database(ROOT, os.environ)
    assert first != second
    for url in (first, second):
        # `migrate --check` fails while any migration of the tree is unapplied.
        check = subprocess.run(
            [sys.executable, str(ROOT / "manage.py"), "migrate", "--check"],
            env={**os.environ, "DATABASE_URL": url}, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert check.returncode == 0, check.stdout + check.stderr
    # What one stack writes, the other does not see.
    with sqlite3.connect(path_of(first)) as connection:
        connection.execute("CREATE TABLE written_by_the_first (id INTEGER)")
    with sqlite3.connect(path_of(second)) as connection:
        names = {row[0] for row in connection.execute("SELECT name FROM sqlite_master")}
    assert "written_by_the_first" not in names
