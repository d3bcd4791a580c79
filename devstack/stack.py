"""Start and stop a whole local service: Redis (embedded unless REDIS_URL is set), one Celery
worker per GPU (one CPU worker without GPUs) and gunicorn. Used by `make run` and by the
tests' fixtures, so both exercise the same processes started the same way.

    python -m devstack.stack        # what `make run` runs after installing
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from config.env import env_int, env_models, env_str
from devstack.embedded_redis import EmbeddedRedis, free_port

ROOT = Path(__file__).resolve().parents[1]


def _http_status(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - our http://
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# One migrated SQLite file per tree, copied for each stack that asks for a database of its own.
_MIGRATED: dict[Path, Path] = {}


def migrated_database(root: Path, env: Mapping[str, str]) -> str:
    """The URL of a new SQLite database with `root`'s migrations applied: a copy of one
    migrated once per tree and process (a migration takes seconds, a copy nothing)."""
    template = _MIGRATED.get(root)
    if template is None:
        template = Path(tempfile.mkdtemp(prefix="stack-db-")) / "migrated.sqlite3"
        subprocess.run(
            [sys.executable, str(root / "manage.py"), "migrate", "--noinput", "-v0"],
            cwd=root, env={**env, "DATABASE_URL": f"sqlite:///{template}"}, check=True,
        )  # fmt: skip
        _MIGRATED[root] = template
    copy = Path(tempfile.mkdtemp(prefix="stack-db-")) / "db.sqlite3"
    shutil.copyfile(template, copy)
    return f"sqlite:///{copy}"


@dataclass
class Stack:
    env: dict[str, str] = field(default_factory=dict)  # overrides for every process
    gpus: list[int | None] = field(default_factory=lambda: [None])  # None: a CPU worker
    web_processes: int = 2
    worker_args: list[str] = field(default_factory=list)  # extra `celery worker` arguments
    web_config: Path | None = None  # None: the tree's inference_site/gunicorn.conf.py
    # The tree whose code the processes run: this one, or an older checkout that a benchmark
    # measures against (bench/gap.py --against).
    root: Path = ROOT
    port: int = 0
    log_dir: Path | None = None  # None: the processes write to this terminal
    # A migrated database of the stack's own, unless DATABASE_URL is set: a benchmark's stack
    # must not share the tree's db.sqlite3, whose keys and policy its web processes would
    # publish over the benchmark's (or fail on every housekeeping run, when not migrated).
    own_database: bool = False
    redis: EmbeddedRedis | None = None
    # The embedded Redis's port (0: a free one); `make run` asks for the settings' default.
    redis_port: int = 0
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    worker_gpus: list[int | None] = field(default_factory=list)  # each worker's, in order
    # Each worker's model and sampler, in order (None: SAMPLING_QUEUE's, with SAMPLER).
    worker_models: list[tuple[str, str] | None] = field(default_factory=list)
    web: subprocess.Popen[bytes] | None = None
    # The offline jobs' feeder (`manage.py runfeeder`); False: none started.
    feeds: bool = True
    feeder: subprocess.Popen[bytes] | None = None
    # Where each web process marks itself booted (gunicorn.conf.py's post_worker_init): None
    # when the config is not this tree's, which may not mark (an older checkout benchmarked).
    _ready_dir: Path | None = None
    _logs: list[IO[bytes]] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def environment(self) -> dict[str, str]:
        env = {**os.environ, **self.env}
        env.setdefault("DJANGO_SETTINGS_MODULE", "inference_site.settings")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.root), env.get("PYTHONPATH")]))
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
            self.redis = self._start_redis()
            self.env["REDIS_URL"] = self.redis.url
        if not self.port:
            self.port = env_int("PORT", 0, environ=self.env) or free_port()
        if self.own_database and "DATABASE_URL" not in self.environment():
            self.env["DATABASE_URL"] = migrated_database(self.root, self.environment())
        for gpu, model in self.worker_plan():
            self.start_worker(gpu, model)
        self.start_web()
        # An older tree (a benchmark's baseline) may have no feeder to start.
        if (
            self.feeds
            and (self.root / "offline" / "management" / "commands" / "runfeeder.py").exists()
        ):
            self.start_feeder()
        self.wait_ready(timeout_s, need_worker=bool(self.gpus))
        return self

    def _start_redis(self) -> EmbeddedRedis:
        """On `redis_port` when it is free, else on a free port."""
        if self.redis_port:
            try:
                return EmbeddedRedis(self.redis_port).start()
            except RuntimeError:
                pass  # another server holds it
        return EmbeddedRedis().start()

    def worker_plan(self) -> list[tuple[int | None, tuple[str, str] | None]]:
        """One worker per GPU of `gpus` (None: a CPU worker) for the one model; with
        SAMPLING_MODELS listing several, at least one worker per model, the GPUs dealt to
        the models in turn."""
        environ = self.environment()
        models = env_models("SAMPLING_MODELS", env_str("SAMPLER", "hf", environ), environ)
        if not models or not self.gpus:
            return [(gpu, None) for gpu in self.gpus]
        count = max(len(self.gpus), len(models))
        return [(self.gpus[i % len(self.gpus)], models[i % len(models)]) for i in range(count)]

    def start_worker(
        self, gpu: int | None, model: tuple[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """A worker on `gpu` (None: a CPU worker) for `model` (name, sampler; None: the
        environment's); a second one of the same model on the same GPU or on CPU gets a name
        of its own (workers.launch.worker_command's replica)."""
        replica = sum(1 for at in zip(self.worker_gpus, self.worker_models, strict=True)
                      if at == (gpu, model))  # fmt: skip
        worker = self._spawn_worker(gpu, replica, model)
        self.workers.append(worker)
        self.worker_gpus.append(gpu)
        self.worker_models.append(model)
        return worker

    def restart_worker(self, index: int) -> subprocess.Popen[bytes]:
        """Start the `index`-th worker again, under its name, in place of one that exited."""
        gpu, model = self.worker_gpus[index], self.worker_models[index]
        earlier = list(zip(self.worker_gpus[:index], self.worker_models[:index], strict=True))
        self.workers[index] = self._spawn_worker(gpu, earlier.count((gpu, model)), model)
        return self.workers[index]

    def _spawn_worker(
        self, gpu: int | None, replica: int, model: tuple[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        from workers.launch import worker_command, worker_environment

        env = worker_environment(gpu, self.environment())
        if os.geteuid() == 0:  # a development container's root: Celery's warning is for hosts
            warned = [env.get("PYTHONWARNINGS"), ROOT_WARNING]
            env["PYTHONWARNINGS"] = ",".join(filter(None, warned))
        if model is not None:
            env["SAMPLING_QUEUE"], env["SAMPLER"] = model
        queue = env_str("SAMPLING_QUEUE", "sampling", environ=env)
        suffix = f"-{replica}" if replica else ""
        name = f"{queue}-" if model is not None else ""
        output = self._output(f"worker-{name}{'cpu' if gpu is None else gpu}{suffix}")
        return subprocess.Popen(
            worker_command(gpu, queue, self.worker_args, replica), cwd=self.root, env=env,
            stdout=output, stderr=subprocess.STDOUT if output else None, start_new_session=True,
        )  # fmt: skip

    def start_web(self) -> subprocess.Popen[bytes]:
        env = self.environment()
        env["PORT"] = str(self.port)
        env["WEB_CONCURRENCY"] = str(self.web_processes)
        if self.web_config is None and self.root == ROOT:
            if self._ready_dir is not None:
                shutil.rmtree(self._ready_dir, ignore_errors=True)
            self._ready_dir = Path(tempfile.mkdtemp(prefix="sampling-web-ready-"))
            env["WEB_READY_DIR"] = str(self._ready_dir)
        output = self._output("web")
        config = self.web_config or self.root / "inference_site" / "gunicorn.conf.py"
        self.web = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-c", str(config)],
            cwd=self.root, env=env, stdout=output, stderr=subprocess.STDOUT if output else None,
            start_new_session=True,
        )  # fmt: skip
        return self.web

    def start_feeder(self) -> subprocess.Popen[bytes]:
        output = self._output("feeder")
        self.feeder = subprocess.Popen(
            [sys.executable, str(self.root / "manage.py"), "runfeeder"], cwd=self.root,
            env=self.environment(), stdout=output, stderr=subprocess.STDOUT if output else None,
            start_new_session=True,
        )  # fmt: skip
        return self.feeder

    def wait_ready(self, timeout_s: float, need_worker: bool = True) -> None:
        path = "/readyz" if need_worker else "/healthz"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for process in [self.web, self.feeder, *self.workers]:
                if process is not None and process.poll() is not None:
                    raise RuntimeError(f"{process.args!r} exited with {process.returncode}")
            # Every web process booted, not only the first to answer: a request accepted by one
            # still importing would wait, and the booting one takes the CPU the others serve on.
            if self._web_processes_booted() and all(
                _http_status(self.base_url + path + query) == 200 for query in self._ready_queries()
            ):
                return
            time.sleep(0.2)
        raise RuntimeError(f"{self.base_url}{path} not ready after {timeout_s} s")

    def _ready_queries(self) -> list[str]:
        """/readyz for the default model, and for each other model a worker was started for."""
        models = {model[0] for model in self.worker_models if model is not None}
        return ["", *(f"?model={name}" for name in sorted(models))]

    def _web_processes_booted(self) -> bool:
        if self._ready_dir is None:
            return True
        return sum(_alive(int(marker.name)) for marker in self._ready_dir.iterdir()) >= (
            self.web_processes
        )

    def stop_process(self, process: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
        if process.poll() is None:
            process.send_signal(sig)
            _reap(process)

    def stop(self) -> None:
        """Stop every process at once (each shuts down gracefully, in parallel), then Redis."""
        processes = [p for p in (self.web, self.feeder, *self.workers) if p is not None]
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes:
            _reap(process)
        if self.redis is not None:
            self.redis.stop()
        for handle in self._logs:
            handle.close()
        self._logs.clear()
        if self._ready_dir is not None:
            shutil.rmtree(self._ready_dir, ignore_errors=True)


# Celery's warning to a worker run as root, left out of a local stack (deployments run as a user).
ROOT_WARNING = "ignore:You're running the worker with superuser privileges:Warning"


def _reap(process: subprocess.Popen[bytes], timeout_s: float = 15) -> None:
    """Wait for a signalled process to exit; kill it when it has not within `timeout_s`."""
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# A process that exits is started again after a back-off that doubles with each exit in a row
# (1, 2, 4 ... 30 s), as systemd's Restart=always would with a growing RestartSec; a process
# that ran this long before it exited starts again after the first step.
RESTART_FIRST_S = 1.0
RESTART_MAX_S = 30.0
STABLE_S = 60.0


@dataclass
class _Supervised:
    name: str
    process: subprocess.Popen[bytes]
    start: Callable[[], subprocess.Popen[bytes]]
    started: float  # monotonic
    exits_in_a_row: int = 0
    restart_at: float | None = None

    def check(self, now: float, say: Callable[[str], None]) -> None:
        if self.restart_at is not None:
            if now >= self.restart_at:
                self.process = self.start()
                self.started, self.restart_at = now, None
                say(f"{self.name} started again (pid {self.process.pid})")
            return
        status = self.process.poll()
        if status is None:
            return
        ran_s = now - self.started
        self.exits_in_a_row = 1 if ran_s >= STABLE_S else self.exits_in_a_row + 1
        delay_s = min(RESTART_MAX_S, RESTART_FIRST_S * 2 ** (self.exits_in_a_row - 1))
        say(
            f"{self.name} (pid {self.process.pid}) exited with status {status} after "
            f"{ran_s:.1f} s; starting it again in {delay_s:g} s"
        )
        self.restart_at = now + delay_s


class Supervisor:
    """Keeps a started stack's processes running, as systemd does the deployed units: each
    worker (a hung call ends its process on purpose), gunicorn's master and the feeder."""

    def __init__(self, stack: Stack, say: Callable[[str], None] | None = None) -> None:
        now = time.monotonic()
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        assert stack.web is not None, "start the stack first"
        self.processes = [_Supervised("gunicorn", stack.web, stack.start_web, now)]
        if stack.feeder is not None:
            self.processes.append(_Supervised("feeder", stack.feeder, stack.start_feeder, now))
        for index, worker in enumerate(stack.workers):
            gpu, model = stack.worker_gpus[index], stack.worker_models[index]
            name = f"worker {'cpu' if gpu is None else f'gpu{gpu}'}"
            if model is not None:
                name += f" of {model[0]}"
            restart = functools.partial(stack.restart_worker, index)
            self.processes.append(_Supervised(name, worker, restart, now))

    def check(self) -> None:
        now = time.monotonic()
        for process in self.processes:
            process.check(now, self.say)

    def run(self, poll_s: float = 0.25) -> None:
        """Until interrupted."""
        while True:
            self.check()
            time.sleep(poll_s)


# A 135M-parameter model on a laptop CPU takes ~1 s for one prompt and ~9 s for a batch of
# 100 (docs/benchmarks/model.md): the GPU's 500 ms deadline cannot hold. Without a GPU,
# `make run` serves the real model with these instead, unless they are set. The call timeout
# too: a CPU call's time grows with its batch, so 10 x the estimate (of calls mostly small at
# low load) could cut off a full batch that is merely slow.
CPU_PROFILE = {
    "SAMPLING_MAX_NEW_TOKENS": "16",
    "SAMPLING_DEADLINE_MS": "15000",
    "SAMPLING_CALL_TIMEOUT_MS": "60000",
}


def cpu_profile(environ: Mapping[str, str]) -> dict[str, str]:
    """The CPU profile's settings that `environ` leaves unset, when the sampler is a model."""
    if env_str("SAMPLER", "hf", environ=environ) != "hf":
        return {}
    return {name: value for name, value in CPU_PROFILE.items() if not environ.get(name, "").strip()}


# The port of the settings' REDIS_URL when it is unset: a manage.py command in another terminal
# then finds `make run`'s embedded Redis, when no other server holds the port.
DEFAULT_REDIS_PORT = 6379


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
        redis_port=DEFAULT_REDIS_PORT,
    )
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt

    # Ctrl-C, a kill, the terminal closed: stop once; a second Ctrl-C must not cut the stop
    # short, which would leave Redis (in a session of its own) running.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)
    try:
        where = os.environ.get("REDIS_URL") or "an embedded Redis"
        plan = stack.worker_plan()
        kind = "GPU" if gpus != [None] else "CPU (no GPU found)"
        models = sorted({model[0] for _, model in plan if model is not None})
        served = f" for {', '.join(models)}" if models else ""
        print(f"Starting {len(plan)} {kind} worker(s){served}, gunicorn and the feeder on "
              f"{where} ...", flush=True)  # fmt: skip
        stack.start(timeout_s=300)
        if stack.redis is not None and stack.redis.port != DEFAULT_REDIS_PORT:
            print(
                f"\nPort {DEFAULT_REDIS_PORT} is taken, so the embedded Redis listens on "
                f"{stack.redis.port}. In another terminal, before a manage.py command:\n"
                f"  export REDIS_URL={stack.redis.url}",
                flush=True,
            )
        print(
            f"\nReady: {stack.base_url}  (Ctrl-C stops everything)\n"
            f'  curl -s localhost:{stack.port}/sample -d "E equals "\n',
            flush=True,
        )
        Supervisor(stack).run()
    except KeyboardInterrupt:
        print("\nStopping ...", flush=True)
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
