"""The quickstart page's commands as a newcomer runs them, copied from the page: `make run`
with the simulated sampler, then the page's curl line and its `openai` snippet, each
answering what the page shows. The only change to what the page says is the port: the page
says 8000, the test takes a free one (PORT, which `make run` reads)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.http import request
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "getting-started" / "quickstart.md"
PAGE_PORT = "localhost:8000"


def _section(title: str) -> str:
    text = PAGE.read_text()
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def _indented_blocks(text: str) -> list[list[str]]:
    blocks: list[list[str]] = []
    previous = ""
    for line in text.splitlines():
        if line.startswith("    "):
            if not previous.startswith("    "):
                blocks.append([])
            blocks[-1].append(line[4:])
        previous = line
    return blocks


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`make run` as the page says, with the simulated sampler (the page's outputs are its)."""
    commands = _indented_blocks(_section("Two commands"))[0]
    run = next(line.split("#", 1)[0].strip() for line in commands if line.startswith("make run"))
    assert run == "make run"
    port = _free_port()
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("REDIS_", "SAMPLING_", "CELERY_"))}  # fmt: skip
    database = tmp_path_factory.mktemp("quickstart") / "db.sqlite3"
    env |= {"SAMPLER": "simulated", "PORT": str(port), "WEB_CONCURRENCY": "1",
            "DATABASE_URL": f"sqlite:///{database}"}  # fmt: skip
    log = (tmp_path_factory.mktemp("quickstart-log") / "make-run.log").open("wb")
    process = subprocess.Popen(
        run.split(), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True, preexec_fn=_ctrl_c_heard,
    )  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert process.poll() is None, Path(log.name).read_text()
            try:
                return request(base_url, "/readyz", method="GET").status == 200
            except OSError:
                return False

        wait_until(ready, 120, "make run serving, with a live worker")
        yield f"localhost:{port}"
    finally:
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C, as the page says
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()
        # The stack's processes run in sessions of their own: any left behind would take the
        # next tests' CPU. Stopped, and named in the warnings summary.
        if left := _processes_with(f"PORT={port}"):
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            warnings.warn(f"make run left {sorted(left.values())} running", stacklevel=1)


def _ctrl_c_heard() -> None:
    """In `make run`'s process, before it starts: SIGINT's default action, as in a terminal. A
    test run started in the background by a script inherits SIGINT ignored, and so would
    make and the stack, which then never stopped."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _processes_with(variable: str) -> dict[int, str]:
    """This user's processes whose environment holds `variable` (NAME=value): pid, command."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone, or another user's
            continue
        if variable.encode() in environ:
            found[int(entry.name)] = command.strip()
    return found


def test_the_curl_line_answers_what_the_page_shows(served: str) -> None:
    [command, shown] = _indented_blocks(_section("First requests"))[0]
    assert command.startswith("curl")
    assert PAGE_PORT in command
    done = subprocess.run(  # noqa: S602 - the page's own command line
        command.replace(PAGE_PORT, served), shell=True, capture_output=True, text=True,
        check=True, timeout=30,
    )  # fmt: skip
    assert done.stdout.strip() == shown.strip()


def test_the_openai_snippet_prints_what_the_page_shows(served: str) -> None:
    code = _section("First requests").split("```python\n", 1)[1].split("```", 1)[0]
    shown = re.findall(r"print\(.*\)\s+# (.+?) \(", code)
    assert shown  # the page shows what the snippet prints
    done = subprocess.run(
        [sys.executable, "-c", code.replace(PAGE_PORT, served)], capture_output=True,
        text=True, check=False, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == shown


def test_the_api_guides_openai_snippet_runs(served: str) -> None:
    """The API guide's `openai` snippet (completions, chat with its settings, a stream), as
    written, against the simulated stack: every call answered."""
    page = (ROOT / "docs" / "guides" / "api.md").read_text()
    code = page.split("```python\n", 1)[1].split("```", 1)[0]
    assert PAGE_PORT in code
    done = subprocess.run(
        [sys.executable, "-c", code.replace(PAGE_PORT, served)], capture_output=True,
        text=True, check=False, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()  # the stream's text


def test_the_api_guides_curl_line_answers_what_the_page_shows(served: str) -> None:
    """The API guide's curl lines before its note that their completions are the simulated
    sampler's: each answer equals the one shown but for its id and creation time."""
    page = (ROOT / "docs" / "guides" / "api.md").read_text()
    simulated = page.split("are the simulated sampler's", 1)[0]
    checked = 0
    for block in _indented_blocks(simulated):
        if not block[0].startswith("curl"):
            continue
        ends = next(i for i, line in enumerate(block) if not line.endswith("\\"))
        command, shown = "\n".join(block[: ends + 1]), json.loads("".join(block[ends + 1 :]))
        done = subprocess.run(  # noqa: S602 - the page's own command line
            command.replace(PAGE_PORT, served), shell=True, capture_output=True, text=True,
            check=True, timeout=30,
        )  # fmt: skip
        answer = json.loads(done.stdout)
        for varying in ("id", "created"):
            assert type(answer.pop(varying)) is type(shown.pop(varying))
        assert answer == shown
        checked += 1
    assert checked
