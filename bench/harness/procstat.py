"""What the processes under test spend: CPU of a process tree and its connections (from
/proc), and a Redis server's CPU and commands (from INFO)."""

from __future__ import annotations

import contextlib
import os
import urllib.request
from pathlib import Path
from typing import NamedTuple

import redis

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of a process and its children (gunicorn master and its
    workers)."""
    total = 0.0
    pids = [pid]
    with contextlib.suppress(OSError):
        pids += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime
    return total


def accept_queue(port: int) -> int:
    """Connections waiting in the kernel's accept queue of the socket listening on `port`
    (its rx_queue in /proc/net/tcp): accepted by TCP, not yet by the server, where no
    code of the server runs and no deadline is counted. 0 when none listens."""
    waiting = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, state, queues = fields[1], fields[3], fields[4]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # LISTEN
                    waiting += int(queues.split(":")[1], 16)
    return waiting


def accepted_connections(port: int) -> int:
    """Open connections the server listening on `port` has accepted (established ones, less
    those still in its accept queue): what holds its connection slots."""
    established = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, state = fields[1], fields[3]
                if state == "01" and int(local.rsplit(":", 1)[1], 16) == port:  # ESTABLISHED
                    established += 1
    return max(0, established - accept_queue(port))


class RedisCpu(NamedTuple):
    """A Redis server's CPU seconds (user + system) since it started."""

    total_s: float  # the whole process, io threads included
    main_thread_s: float  # its main thread (NaN where the server does not say)


def redis_cpu(client: redis.Redis) -> RedisCpu:
    info = client.info("cpu")
    main = float(info.get("used_cpu_sys_main_thread", "nan")) + float(
        info.get("used_cpu_user_main_thread", "nan")
    )
    return RedisCpu(float(info["used_cpu_sys"]) + float(info["used_cpu_user"]), main)


def redis_commands(client: redis.Redis) -> int:
    """Commands Redis has run since it started (INFO commandstats, those Lua runs included)."""
    return sum(stat["calls"] for stat in client.info("commandstats").values())


def metric_samples(port: int, family: str) -> list[tuple[str, float]]:
    """The samples of a metric `family` on the web process at `port` (/metrics): each
    sample's labels as written (`{reason="late"}`, or "" without labels) and its value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = []
    for line in text.splitlines():
        if line.startswith((family + "{", family + " ")):
            name_labels, value = line.rsplit(" ", 1)
            samples.append((name_labels[len(family) :], float(value)))
    return samples
