"""Where uploads arrive (offline.uploads): a file its killed web process left is swept once it
is older than any upload takes; one still arriving stays."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from django.test import override_settings

from offline import uploads


def test_only_abandoned_uploads_are_swept(tmp_path: Path) -> None:
    left = tmp_path / f"left{uploads.SUFFIX}"
    arriving = tmp_path / f"arriving{uploads.SUFFIX}"
    other = tmp_path / "not-an-upload"
    for path in (left, arriving, other):
        path.write_bytes(b"{}\n")
    old = time.time() - uploads.ABANDONED_S - 60
    os.utime(left, (old, old))
    os.utime(other, (old, old))
    with override_settings(SAMPLING_UPLOAD_TEMP_DIR=str(tmp_path)):
        assert uploads.sweep_abandoned() == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [arriving.name, other.name]


@pytest.mark.parametrize("missing", ["never-made"])
def test_no_directory_yet_is_nothing_to_sweep(tmp_path: Path, missing: str) -> None:
    with override_settings(SAMPLING_UPLOAD_TEMP_DIR=str(tmp_path / missing)):
        assert uploads.sweep_abandoned() == 0
