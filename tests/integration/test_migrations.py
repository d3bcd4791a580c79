"""A database made by the migrations of issue 5's layout (everything in one `sampling` app)
migrates to the rooms' layout with its policies, audit log and statistics intact.

tests/data/db-before-issue-11.sql is that database, dumped (sqlite3 iterdump) after
`manage.py migrate`, `createsuperuser` and policy saves, changes and a delete through the
models of that version, plus five minutes of statistics."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from devstack.stack import ROOT

pytestmark = pytest.mark.integration

DUMP = Path(__file__).resolve().parents[1] / "data" / "db-before-issue-11.sql"

READ_THROUGH_THE_MODELS = """
import json
from operations.models import PolicyChange, SamplingPolicy, StatsMinute
print(json.dumps({
    "policies": {p.queue: [p.as_policy().to_json(), p.updated_by]
                 for p in SamplingPolicy.objects.all()},
    "changes": [[c.queue, c.version, c.action, c.changed_by, c.old, c.new]
                for c in PolicyChange.objects.order_by("id")],
    "minutes": [[m.queue, m.minute.isoformat(), m.counts, m.summary.requests()]
                for m in StatsMinute.objects.order_by("id")],
}))
"""


def manage(database: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), *args],
        env={**os.environ, "DATABASE_URL": f"sqlite:///{database}"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_database_of_the_old_layout_migrates_without_loss(tmp_path: Path) -> None:
    database = tmp_path / "db.sqlite3"
    with sqlite3.connect(database) as connection:
        connection.executescript(DUMP.read_text())
        before = {
            table: connection.execute(f"SELECT * FROM {table} ORDER BY id").fetchall()  # noqa: S608
            for table in (
                "sampling_samplingpolicy",
                "sampling_policychange",
                "sampling_statsminute",
            )
        }
    assert all(before.values()), "the dump holds rows of every table"

    migrated = manage(database, "migrate", "--noinput")
    assert migrated.returncode == 0, migrated.stderr[-3000:]
    unmade = manage(database, "makemigrations", "--check", "--dry-run")
    assert unmade.returncode == 0, unmade.stdout + unmade.stderr  # models = migrations

    read = manage(database, "shell", "-c", READ_THROUGH_THE_MODELS)
    assert read.returncode == 0, read.stderr[-3000:]
    after = json.loads(read.stdout.strip().splitlines()[-1])

    # Every policy row, with every setting as it was saved.
    columns = ["id", "queue", "max_batch_size", "deadline_ms", "max_prompt_bytes",
               "max_new_tokens", "temperature", "top_p", "stop", "fill_target_percent",
               "version", "updated_at", "updated_by"]  # fmt: skip
    assert len(after["policies"]) == len(before["sampling_samplingpolicy"])
    for row in before["sampling_samplingpolicy"]:
        old = dict(zip(columns, row, strict=True))
        policy_json, updated_by = after["policies"][old["queue"]]
        policy = json.loads(policy_json)
        for name in columns[2:11]:
            assert policy[name] == old[name], (old["queue"], name)
        assert updated_by == old["updated_by"]
    # The audit log, in order, with its old and new settings.
    assert [
        [queue, version, action, by, json.loads(old), json.loads(new)]
        for _, queue, version, _, by, action, old, new in before["sampling_policychange"]
    ] == after["changes"]
    # The statistics minutes, readable as summaries.
    assert [[m[1], json.loads(m[3])] for m in before["sampling_statsminute"]] == [
        [queue, counts] for queue, _, counts, _ in after["minutes"]
    ]
    assert all(requests > 0 for *_, requests in after["minutes"])
