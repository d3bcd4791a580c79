"""`make run` as a newcomer runs it, in a process group of its own that hears Ctrl-C as a
terminal's would; the simulated sampler, a free port and a database of its own."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from tests.support.http import request
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class MakeRun:
    process: subprocess.Popen[bytes]
    port: int
    log: Path
    env: dict[str, str]  # the environment of a second terminal: the same database

    @property
    def address(self) -> str:
        return f"localhost:{self.port}"

    def stop(self) -> int:
        """Ctrl-C, as the pages say; the exit status of make, once every process of the stack
        (Redis last) has exited: make itself exits at once, as in a terminal."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
        try:
            status = self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            status = self.process.wait()
        wait_until(lambda: not _processes_with(f"PORT={self.port}"), 60, "the stack stopped")
        return status


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def terminal_environment(database: Path) -> dict[str, str]:
    """This environment without the tests' Redis and service settings, as a new shell has it,
    with the database the pages' commands and the stack share."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("REDIS_", "SAMPLING_", "CELERY_", "DJANGO_SECRET"))}  # fmt: skip
    return env | {"SAMPLER": "simulated", "DATABASE_URL": f"sqlite:///{database}"}


@contextmanager
def make_run(directory: Path, timeout_s: float = 120) -> Iterator[MakeRun]:
    port = free_port()
    env = terminal_environment(directory / "db.sqlite3")
    log = directory / "make-run.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            ["make", "run"], cwd=ROOT, env=env | {"PORT": str(port), "WEB_CONCURRENCY": "1"},
            stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_ctrl_c_heard,
        )  # fmt: skip
    running = MakeRun(process, port, log, env)
    try:

        def ready() -> bool:
            assert process.poll() is None, log.read_text()
            if "\nReady: " not in log.read_text():  # printed after whatever a newcomer must do
                return False
            try:
                return request(f"http://127.0.0.1:{port}", "/readyz", method="GET").status == 200
            except OSError:
                return False

        wait_until(ready, timeout_s, "make run serving, with a live worker")
        # What `make run` tells a second terminal to export when Redis's usual port is taken.
        exported = re.search(r"^  export REDIS_URL=(\S+)$", log.read_text(), flags=re.M)
        if exported is not None:
            running.env["REDIS_URL"] = exported.group(1)
        yield running
    finally:
        try:
            running.stop()
        finally:
            # The stack's processes run in sessions of their own: any left behind would take
            # the next tests' CPU. Stopped, and named in the warnings summary.
            if left := _processes_with(f"PORT={port}"):
                for pid in left:
                    with suppress(ProcessLookupError):
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
