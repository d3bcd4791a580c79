"""Start the Celery worker of one GPU (or one CPU worker).

    python -m workers.launch --gpu 0      # pinned to GPU 0 by CUDA_VISIBLE_DEVICES=0
    python -m workers.launch --cpu        # no GPU: CUDA_VISIBLE_DEVICES is emptied

It execs `celery worker` with the flags this service needs: the solo pool (CUDA must not be
initialised in a forked child), concurrency 1 (a GPU runs one call at a time), prefetch 1 (a
free GPU pulls the next batch; none waits behind a busy one), and the queue of the served
model. Extra arguments after `--` go to celery unchanged.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

from config.env import env_name


def local_gpu_count() -> int:
    """GPUs that nvidia-smi lists on this machine; 0 without a driver."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        listing = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in listing.splitlines() if line.startswith("GPU "))


def worker_command(
    gpu: int | None, queue: str, extra: list[str] | None = None, replica: int = 0
) -> list[str]:
    """The worker of `gpu` (None: CPU) for `queue`, named `{queue}-gpu{N}@host` (`-cpu@`).
    Names must be unique among live workers (a duplicate refuses to start: workers.lifecycle):
    `replica` n > 0 names the n-th further worker of the same GPU or CPU `...-cpu-n@host`."""
    node = f"gpu{gpu}" if gpu is not None else "cpu"
    if replica:
        node = f"{node}-{replica}"
    return [
        sys.executable, "-m", "celery", "-A", "inference_site", "worker",
        "--pool", "solo", "--concurrency", "1", "--prefetch-multiplier", "1",
        "--queues", queue, "--hostname", f"{queue}-{node}@%h",
        "--without-mingle", "--without-gossip",
        "--loglevel", os.environ.get("LOG_LEVEL", "info").lower(),
        *(extra or []),
    ]  # fmt: skip


def worker_environment(gpu: int | None, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["CUDA_VISIBLE_DEVICES"] = "" if gpu is None else str(gpu)
    env.setdefault("DJANGO_SETTINGS_MODULE", "inference_site.settings")
    # A worker never downloads weights while serving: a Hub model must be in the local cache
    # (`hf download`), or the operator sets HF_HUB_OFFLINE=0 knowingly.
    env.setdefault("HF_HUB_OFFLINE", "1")
    # Progress bars (downloads; transformers' GGUF conversion uses plain tqdm) only clutter
    # a worker's log.
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    env.setdefault("TQDM_DISABLE", "1")
    # A worker publishes its metrics through Redis (workers/metrics.py); in the web
    # processes' multiprocess directory they would be counted twice.
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return env


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--gpu", type=int, help="index of the GPU this worker is pinned to")
    target.add_argument("--cpu", action="store_true", help="a CPU worker (no GPU)")
    parser.add_argument("celery_args", nargs="*", help="passed to celery after --")
    args = parser.parse_args(argv)
    queue = env_name("SAMPLING_QUEUE", "sampling")
    command = worker_command(None if args.cpu else args.gpu, queue, args.celery_args)
    # The worker replaces this process: no shell, arguments built above.
    os.execvpe(command[0], command, worker_environment(None if args.cpu else args.gpu))  # noqa: S606


if __name__ == "__main__":
    main()
