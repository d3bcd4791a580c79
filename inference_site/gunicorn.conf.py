"""gunicorn settings for a web node: `gunicorn -c inference_site/gunicorn.conf.py`.

gevent workers: a waiting request costs a greenlet, not a thread or a process, so one process
holds thousands of waits while its CPU goes to the few microseconds each request needs
(measured figures in docs/benchmarks/frontend.md). WEB_CONCURRENCY processes x
WEB_WORKER_CONNECTIONS waits.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
from pathlib import Path

from config.env import env_int, env_str

bind = f"{env_str('HOST', '127.0.0.1')}:{env_int('PORT', 8000, minimum=1, maximum=65535)}"
worker_class = "gevent"
workers = env_int("WEB_CONCURRENCY", multiprocessing.cpu_count(), minimum=1)
worker_connections = env_int("WEB_WORKER_CONNECTIONS", 2000, minimum=1)
backlog = 4096
# What a request's head may be (gunicorn's defaults, set here so that they are on record):
# longer request lines get 414, more or longer header fields 431 (docs/reliability.md).
# Our URLs are short and clients send a few headers; a prompt travels in the body.
limit_request_line = env_int("WEB_LIMIT_REQUEST_LINE", 4094, minimum=256, maximum=8190)
limit_request_fields = env_int("WEB_LIMIT_REQUEST_FIELDS", 100, minimum=10, maximum=32768)
limit_request_field_size = env_int("WEB_LIMIT_REQUEST_FIELD_SIZE", 8190, minimum=1024)
# A request never runs longer than its deadline; this only catches a wedged process.
timeout = 30
graceful_timeout = 10
keepalive = 5
accesslog = None if os.environ.get("WEB_ACCESS_LOG", "") in ("", "0") else "-"
errorlog = "-"
loglevel = env_str("LOG_LEVEL", "info").lower()
wsgi_app = "inference_site.wsgi:application"

# Prometheus multiprocess mode: each web process writes its metrics to files in this
# directory and GET /metrics sums them. Set here, in the master, before any worker imports
# prometheus_client. Emptied at start: files of an earlier run would be counted again.
if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="sampling-prometheus-")


def on_starting(server: object) -> None:
    directory = Path(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.db"):  # only prometheus_client's own files
        stale.unlink()


def child_exit(server: object, worker: object) -> None:
    """A dead process's live gauges go; its counters stay in the sums (they are still true)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)  # type: ignore[attr-defined]


def worker_exit(server: object, worker: object) -> None:
    """In each web process as it leaves (SIGTERM: after its requests ended): its last counts
    (the keys' usage among them) flushed to Redis, not lost with it."""
    from serving.runtime import flush_on_exit

    flush_on_exit()


def post_worker_init(worker: object) -> None:
    """In each web process, after gevent's patching: connect before the first request."""
    from serving.runtime import warm_up

    warm_up()
    # For whoever started gunicorn and waits for every process, not just the first one that
    # answers (devstack/stack.py): this process has booted and now accepts requests.
    ready_dir = os.environ.get("WEB_READY_DIR")
    if ready_dir:
        Path(ready_dir, str(os.getpid())).touch()
