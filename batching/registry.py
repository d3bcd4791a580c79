"""The workers of a queue, as the web processes and the operators see them: heartbeats (in
Redis time), the live count, each worker's last record, and a worker's goodbye."""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import redis

from batching import scripts
from batching.keys import QueueKeys
from batching.lanes import SCRIPT_CONSTANTS

# A worker that has not heartbeated for this long is not counted (admission, /readyz).
HEARTBEAT_TIMEOUT_MS = 5000


class LiveWorkers(NamedTuple):
    """A queue's live workers, and whether every one of them (at least one) reads an item's
    whole deadline: web processes write it then only (a rolling upgrade's older workers
    cannot read it)."""

    live: int
    read_deadlines: bool


class WorkerRegistry:
    """The live workers of a queue (a zset of their last heartbeats) and their records."""

    def __init__(self, client: redis.Redis, keys: QueueKeys) -> None:
        self.client = client
        self.keys = keys
        self.script = scripts.register(client, "heartbeat", SCRIPT_CONSTANTS)
        self.claim_script = scripts.register(client, "claim_name")

    def heartbeat(self, worker: str, now_ms: int | None = None) -> int:
        """Record a live worker and return the number of live workers of this queue (at
        `now_ms`; None: the Redis node's time)."""
        return self._heartbeat(worker, now_ms).live

    def live_count(self, now_ms: int | None = None) -> int:
        """How many workers heartbeated within HEARTBEAT_TIMEOUT_MS."""
        return self._heartbeat("", now_ms).live

    def live(self, now_ms: int | None = None) -> LiveWorkers:
        """The live workers' count, and whether every one reads an item's whole deadline."""
        return self._heartbeat("", now_ms)

    def _heartbeat(self, worker: str, now_ms: int | None) -> LiveWorkers:
        args: list[str | int] = [worker, HEARTBEAT_TIMEOUT_MS]
        if now_ms is not None:
            args.append(now_ms)
        keys = [self.keys.live_workers, self.keys.deadline_readers]
        live, readers = self.script(keys=keys, args=args)
        return LiveWorkers(int(live), int(readers) >= int(live) > 0)

    def infos(self, since_s: float) -> list[tuple[str, dict[str, Any]]]:
        """The queue's workers seen since `since_s` (epoch seconds), each with its last
        heartbeat's record ({} when it expired or cannot be read): two round trips."""
        names = [
            name.decode()
            for name in self.client.zrange(
                self.keys.known_workers, int(since_s), "+inf", byscore=True
            )
        ]
        if not names:
            return []
        raws = self.client.mget([self.keys.worker_info(name) for name in names])
        return [(name, _worker_info(raw)) for name, raw in zip(names, raws, strict=True)]

    def claim(self, worker: str, token: str) -> str | None:
        """Claim the name `worker` for the process `token` (or renew its claim) for
        HEARTBEAT_TIMEOUT_MS: None when this process holds it now, else the token of the
        live process that holds it."""
        return _owner(self.claim_script(keys=[self.keys.worker_owner(worker)],
                                        args=[token, HEARTBEAT_TIMEOUT_MS]))  # fmt: skip

    def release(self, worker: str, token: str) -> None:
        """A stopping process gives its name up (only its own claim)."""
        self.claim_script(keys=[self.keys.worker_owner(worker)], args=[token, 0])

    def forget(self, worker: str) -> None:
        """A stopping worker's goodbye: it is no longer counted live."""
        with self.client.pipeline(transaction=False) as pipe:
            pipe.zrem(self.keys.live_workers, worker)
            pipe.zrem(self.keys.deadline_readers, worker)
            pipe.execute()


def _worker_info(raw: bytes | None) -> dict[str, Any]:
    try:
        info = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def _owner(raw: bytes | str | None) -> str | None:
    if raw is None:
        return None
    return raw.decode() if isinstance(raw, bytes) else str(raw)
