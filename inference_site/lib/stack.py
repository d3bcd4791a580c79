"""Start and stop a whole local service: Redis (embedded unless REDIS_URL is set), one Celery
worker per GPU (one CPU worker without GPUs) and gunicorn. Used by `make run` and by the
tests' fixtures, so both exercise the same processes started the same way.

    python -m inference_site.lib.stack        # what `make run` runs after installing
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from inference_site.lib.embedded_redis import EmbeddedRedis, free_port
from inference_site.lib.env import env_int, env_str

ROOT = Path(__file__).resolve().parents[2]


def _http_status(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - our http://
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


@dataclass
class Stack:
    env: dict[str, str] = field(default_factory=dict)  # overrides for every process
    gpus: list[int | None] = field(default_factory=lambda: [None])  # None: a CPU worker
    web_processes: int = 2
    worker_args: list[str] = field(default_factory=list)  # extra `celery worker` arguments
    web_config: Path = ROOT / "inference_site" / "gunicorn.conf.py"
    port: int = 0
    log_dir: Path | None = None  # None: the processes write to this terminal
    redis: EmbeddedRedis | None = None
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    web: subprocess.Popen[bytes] | None = None
    _logs: list[IO[bytes]] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def environment(self) -> dict[str, str]:
        env = {**os.environ, **self.env}
        env.setdefault("DJANGO_SETTINGS_MODULE", "inference_site.settings")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        return env

    def _output(self, name: str) -> IO[bytes] | None:
        if self.log_dir is None:
            return None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        handle = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
        self._logs.append(handle)
        return handle

    def start(self, timeout_s: float = 90.0) -> Stack:
        if not self.env.get("REDIS_URL") and not os.environ.get("REDIS_URL"):
            self.redis = EmbeddedRedis().start()
            self.env["REDIS_URL"] = self.redis.url
        if not self.port:
            self.port = env_int("PORT", 0, environ=self.env) or free_port()
        for gpu in self.gpus:
            self.start_worker(gpu)
        self.start_web()
        self.wait_ready(timeout_s, need_worker=bool(self.gpus))
        return self

    def start_worker(self, gpu: int | None) -> subprocess.Popen[bytes]:
        from workers.launch import worker_command, worker_environment

        env = worker_environment(gpu, self.environment())
        queue = env_str("SAMPLING_QUEUE", "sampling", environ=env)
        output = self._output(f"worker-{'cpu' if gpu is None else gpu}")
        worker = subprocess.Popen(
            worker_command(gpu, queue, self.worker_args), cwd=ROOT, env=env, stdout=output,
            stderr=subprocess.STDOUT if output else None, start_new_session=True,
        )  # fmt: skip
        self.workers.append(worker)
        return worker

    def start_web(self) -> None:
        env = self.environment()
        env["PORT"] = str(self.port)
        env["WEB_CONCURRENCY"] = str(self.web_processes)
        output = self._output("web")
        self.web = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-c", str(self.web_config)],
            cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT if output else None,
            start_new_session=True,
        )  # fmt: skip

    def wait_ready(self, timeout_s: float, need_worker: bool = True) -> None:
        path = "/readyz" if need_worker else "/healthz"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for process in [self.web, *self.workers]:
                if process is not None and process.poll() is not None:
                    raise RuntimeError(f"{process.args!r} exited with {process.returncode}")
            if _http_status(self.base_url + path) == 200:
                return
            time.sleep(0.2)
        raise RuntimeError(f"{self.base_url}{path} not ready after {timeout_s} s")

    def stop_process(self, process: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
        if process.poll() is None:
            process.send_signal(sig)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def stop(self) -> None:
        if self.web is not None:
            self.stop_process(self.web)
        for worker in self.workers:
            self.stop_process(worker)
        if self.redis is not None:
            self.redis.stop()
        for handle in self._logs:
            handle.close()
        self._logs.clear()


# A 135M-parameter model on a laptop CPU takes ~1 s for one prompt and ~9 s for a batch of
# 100 (README, "Measured figures"): the GPU's 500 ms deadline cannot hold. Without a GPU,
# `make run` serves the real model with these instead, unless they are set.
CPU_PROFILE = {"SAMPLING_MAX_NEW_TOKENS": "16", "SAMPLING_DEADLINE_MS": "15000"}


def cpu_profile(environ: Mapping[str, str]) -> dict[str, str]:
    """The CPU profile's settings that `environ` leaves unset, when the sampler is a model."""
    if env_str("SAMPLER", "hf", environ=environ) != "hf":
        return {}
    return {name: value for name, value in CPU_PROFILE.items() if not environ.get(name, "").strip()}


def main() -> None:
    from workers.launch import local_gpu_count

    gpus: list[int | None] = list(range(local_gpu_count())) or [None]
    env = {"PORT": str(env_int("PORT", 8000, minimum=1, maximum=65535))}
    if gpus == [None]:
        profile = cpu_profile(os.environ)
        if profile:
            settings = " ".join(f"{name}={value}" for name, value in profile.items())
            print(
                f"No GPU: serving the model on CPU with {settings}, since one CPU call takes "
                "seconds, not the GPU's 100 ms (set them to override; SAMPLER=simulated for "
                "the contract-exact simulated farm).",
                flush=True,
            )
            env.update(profile)
    stack = Stack(
        env=env,
        gpus=gpus,
        web_processes=env_int("WEB_CONCURRENCY", os.cpu_count() or 1, minimum=1),
    )
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        where = os.environ.get("REDIS_URL") or "an embedded Redis"
        kinds = f"{len(gpus)} GPU worker(s)" if gpus != [None] else "1 CPU worker (no GPU found)"
        print(f"Starting {kinds} and gunicorn on {where} ...", flush=True)
        stack.start(timeout_s=300)
        print(
            f"\nReady: {stack.base_url}  (Ctrl-C stops everything)\n"
            f'  curl -s localhost:{stack.port}/sample -d "E equals "\n',
            flush=True,
        )
        while all(p.poll() is None for p in [stack.web, *stack.workers] if p is not None):
            time.sleep(0.5)
        print("a process exited; stopping the rest", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("\nStopping ...", flush=True)
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
