"""deploy/nginx/ run by this machine's nginx, in front of a local stack, for tests and benches.

The shipped configuration as it is, copied to a temporary directory with its per-site
includes rewritten: the port, the one gunicorn upstream, and (optionally) the networks
trusted with /admin/ and /metrics and the balancers trusted in front. nginx runs in the
foreground as a child of this process.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from devstack.embedded_redis import free_port
from devstack.stack import ROOT

CONFIG_DIR = ROOT / "deploy" / "nginx"


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (path for path in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(path).exists()),
        None,
    )


class Nginx:
    def __init__(
        self,
        upstream_port: int,
        trusted: list[str] | None = None,
        port: int | None = None,
        balancers: list[str] | None = None,
    ) -> None:
        self.upstream_port = upstream_port
        self.trusted = trusted
        self.balancers = balancers
        self.port = port or free_port()
        self.directory = Path(tempfile.mkdtemp(prefix="sampling-nginx-"))
        self.process: subprocess.Popen[bytes] | None = None
        self.log = self.directory / "nginx.log"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> Nginx:
        binary = nginx_binary()
        if binary is None:
            raise FileNotFoundError("nginx is not installed (Debian: apt-get install nginx)")
        config = self.write_config()
        directives = f"daemon off; pid {self.directory / 'nginx.pid'};"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [binary, "-p", str(self.directory), "-c", str(config),
                 "-e", "stderr", "-g", directives],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nginx exited {self.process.returncode}: {self.output()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nginx did not listen on {self.port}: {self.output()}")

    def write_config(self) -> Path:
        """The configuration nginx runs, in `directory`: the shipped one, its per-site
        includes rewritten."""
        for source in CONFIG_DIR.glob("*.conf"):
            shutil.copy(source, self.directory / source.name)
        (self.directory / "listen.conf").write_text(f"listen 127.0.0.1:{self.port};\n")
        (self.directory / "upstream.conf").write_text(f"server 127.0.0.1:{self.upstream_port};\n")
        if self.trusted is not None:
            lines = [f"allow {network};" for network in self.trusted] + ["deny all;"]
            (self.directory / "trusted-networks.conf").write_text("\n".join(lines) + "\n")
        if self.balancers is not None:
            lines = [f"set_real_ip_from {network};" for network in self.balancers]
            lines += ["geo $realip_remote_addr $from_balancer {", "    default 0;"]
            lines += [f"    {network} 1;" for network in self.balancers] + ["}"]
            (self.directory / "balancers.conf").write_text("\n".join(lines) + "\n")
        return self.directory / "nginx.conf"

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()  # nginx's fast shutdown
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> Nginx:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
