"""Exact, cheap waiting on Celery results: one listener per process, subscribed for good.

Stock Celery 5.x waits on the Redis backend in 1 s steps, wakes one waiter per task id per
backend, and holds a pub/sub connection per thread (per greenlet under gevent). Here every
wait of a process goes through one ResultListener, which wakes every local waiter of a batch
at once. The view keeps Celery's API, `app.AsyncResult(batch_id).get(timeout=...)`, because
SharedListenerRedisBackend is the configured result backend (CELERY_RESULT_BACKEND).

A result is stored as Celery stores it (the key `celery-task-meta-<id>`, Celery's meta and
encoding, the results' expiry) and published on its shard's results channel
(batching.keys.ShardKeys.results), not on a channel per task: each listener subscribes to a
shard's channel once, the first time it waits on one of its batches, and never again, so a
batch costs Redis one PUBLISH and no SUBSCRIBE, UNSUBSCRIBE or GET per web process. The batch
id carries its shard's tag, so the key and the channel live on the shard's slot; on a Redis
cluster the listener holds one connection per master and uses sharded pub/sub (SSUBSCRIBE,
SPUBLISH), so a result goes only to its shard's node.

docs/result-waiting.md has the measurements behind this design: stock `get(timeout=0.5)`
returned after about 1.02 s, and under gevent each greenlet got its own backend, pub/sub
connection and drainer.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from functools import cached_property
from typing import Any

import redis
from celery import states
from celery.backends.redis import RedisBackend
from celery.exceptions import TimeoutError as CeleryTimeoutError
from redis.connection import parse_url

from batching.deltas import Feed, RecentDeltas, is_delta, parse_deltas
from batching.keys import results_channel
from batching.result_store import key_prefix, queue_store
from batching.topology import REDIS_FAULTS, is_cluster, redis_client

log = logging.getLogger(__name__)

# How long the pub/sub connection may stay silent before it is PINGed, and declared dead
# after a second silent period.
HEALTH_INTERVAL_S = 5.0
# Every result received is kept this long for waiters that register after it came: a
# waiter registers just after its append, so only a batch answered within that moment needs
# it (a few KB a batch: at 200 batches/s, under 2 MB a process).
RECENT_RESULTS_S = 2.0


class ResultsUnavailable(redis.ConnectionError):
    """The node that would publish the result is unreachable: the wait ends now, not at its
    timeout (the view answers 503)."""


class _Pending:
    __slots__ = ("event", "feeds", "lost", "meta", "waiters")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.meta: dict[str, Any] | None = None
        self.waiters = 0
        self.lost = False
        self.feeds: list[Feed] = []  # the streaming requests' (batching.deltas)

    def done(self) -> None:
        self.event.set()
        for feed in self.feeds:
            feed.wake()


class _Node:
    """One pub/sub connection (to one Redis server, or one master of a cluster) and the
    channels subscribed on it; its own thread (a greenlet under gevent) reads it."""

    def __init__(self, listener: ResultListener, host: str, port: int) -> None:
        self.listener = listener
        self.address = (host, port)
        self.channels: set[str] = set()
        self.conn: redis.Connection | None = None
        self.down = False  # the last connection attempt failed
        self.thread = threading.Thread(
            target=self._run, name=f"result-listener-{host}:{port}", daemon=True
        )

    def subscribe(self, channel: str) -> None:
        """Called with the listener's lock held."""
        self.channels.add(channel)
        if self.conn is not None:
            self.send(self.listener.subscribe_command, channel)
        if not self.thread.is_alive():
            self.thread.start()

    def send(self, *command: str) -> None:
        # Called with the listener's lock held. A command lost with a dying connection is
        # harmless: the reconnect subscribes every channel again.
        if self.conn is None:
            return
        try:
            self.conn.send_command(*command, check_health=False)
        except (redis.ConnectionError, OSError) as exc:
            log.warning("result listener: %s failed: %s", command[0], exc)

    def _run(self) -> None:
        backoff = 0.05
        listener = self.listener
        while True:
            conn = listener.make_connection(*self.address)
            try:
                conn.connect()
                with listener.lock:
                    self.conn, self.down = conn, False
                    for channel in self.channels:
                        conn.send_command(listener.subscribe_command, channel, check_health=False)
                backoff = 0.05
                self._listen(conn)
            except Exception as exc:  # noqa: BLE001 - reconnect on anything; waiters meanwhile
                if not self.down:
                    log.warning(
                        "result listener: %s:%s lost (%s), reconnecting", *self.address, exc
                    )
                with listener.lock:
                    was_connected, self.conn, self.down = self.conn is not None, None, True
                # A connection that dropped gets one immediate retry (a blip: the stored
                # results are read again after it); a node that refuses fails its waiters.
                if not was_connected:
                    listener.fail_pending(self.channels)
            finally:
                conn.disconnect()
            time.sleep(backoff)
            # At most half a second between tries: full service soon after a node returns.
            backoff = min(backoff * 2, 0.5)

    def _listen(self, conn: redis.Connection) -> None:
        silent_periods = 0
        listener = self.listener
        while True:
            if not conn.can_read(timeout=HEALTH_INTERVAL_S):
                silent_periods += 1
                if silent_periods >= 2:
                    raise redis.ConnectionError("no answer to PING")
                with listener.lock:
                    conn.send_command("PING", check_health=False)
                continue
            silent_periods = 0
            reply = conn.read_response()
            if not isinstance(reply, list) or len(reply) < 2:
                continue  # +PONG outside subscribed mode
            kind = reply[0]
            if kind in (b"message", b"smessage"):
                listener.deliver_message(reply[2])
            elif kind in (b"subscribe", b"ssubscribe"):
                listener.check_stored(reply[1].decode())
            elif kind == b"sunsubscribe":
                # The channel's slot moved to another master: subscribe where it lives now.
                listener.resubscribe(reply[1].decode(), self)


class ResultListener:
    """A process's waits on results, served by one subscription per results channel.

    A waiter registers its task id, subscribing the listener to the id's channel if it is new,
    then waits on an event with its remaining time. A result published before the waiter
    registered is found among the recent results (kept RECENT_RESULTS_S), or read from its key
    when a subscription is confirmed (a new channel, or after a reconnect).
    """

    def __init__(self, backend: SharedListenerRedisBackend) -> None:
        self.backend = backend
        self.client = backend.client  # reads stored results; a cluster client on a cluster
        self.cluster = is_cluster(self.client)
        self.subscribe_command = "SSUBSCRIBE" if self.cluster else "SUBSCRIBE"
        url = backend.listener_url
        # RESP2: pub/sub messages arrive as plain replies (redis-py 8 defaults to RESP3, where
        # they are push frames that read_response() hands to a push handler instead).
        self._connection_kwargs = {
            **parse_url(url),
            "protocol": 2,
            "socket_timeout": None,
            "socket_keepalive": True,
            "socket_connect_timeout": 2,
        }
        self.lock = threading.Lock()  # guards what follows, and every write to a connection
        self._pending: dict[str, _Pending] = {}
        self._recent: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._recent_deltas = RecentDeltas(RECENT_RESULTS_S)
        self._nodes: dict[tuple[str, int], _Node] = {}
        self._node_of: dict[str, _Node] = {}  # channel -> the node it is subscribed on
        self._prefix = key_prefix(backend)

    def make_connection(self, host: str, port: int) -> redis.Connection:
        kwargs = dict(self._connection_kwargs)
        kwargs.pop("connection_class", None)
        if "path" in kwargs:  # a unix socket URL
            return redis.UnixDomainSocketConnection(**kwargs)
        kwargs["host"], kwargs["port"] = host, port
        return redis.Connection(**kwargs)

    # --- waiting (any thread) ------------------------------------------------------------
    def wait(self, task_id: str, timeout: float | None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        entry = self._register(task_id)
        try:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not entry.event.wait(remaining):
                raise CeleryTimeoutError("The operation timed out.")
            if entry.lost:
                raise ResultsUnavailable(f"the Redis node of {results_channel(task_id)} is down")
            assert entry.meta is not None
            return dict(entry.meta)
        finally:
            self._unregister(task_id, entry)

    def open_feed(self, task_ids: list[str]) -> Feed:
        """A streaming request's feed of its batches' deltas and answers (batching.deltas),
        waiting on them as `wait` does until `close_feed`."""
        feed = Feed()
        for task_id in dict.fromkeys(task_ids):
            entry = self._register(task_id)
            with self.lock:
                entry.feeds.append(feed)
                for payload in self._recent_deltas.of(task_id):  # those it came too late for
                    feed.add(task_id, parse_deltas(payload))
            feed.waits[task_id] = entry
            if entry.event.is_set():
                feed.wake()
        return feed

    def close_feed(self, feed: Feed) -> None:
        for task_id, entry in feed.waits.items():
            assert isinstance(entry, _Pending)
            with self.lock:
                entry.feeds.remove(feed)
            self._unregister(task_id, entry)

    def pending_count(self) -> int:
        return len(self._pending)

    def waiting_on(self, task_id: str) -> int:
        """How many waits of this process are on `task_id` now."""
        with self.lock:
            entry = self._pending.get(task_id)
            return entry.waiters if entry is not None else 0

    def subscribe(self, channels: list[str]) -> None:
        """Subscribe to `channels` now (a web process's warm-up: its queue's shards), rather
        than on the first wait on each."""
        with self.lock:
            for channel in channels:
                self._ensure_subscribed(channel)

    def _register(self, task_id: str) -> _Pending:
        channel = results_channel(task_id)
        with self.lock:
            entry = self._pending.get(task_id)
            if entry is None:
                entry = self._pending[task_id] = _Pending()
                recent = self._recent.get(task_id)
                if recent is not None:
                    self._set_meta(entry, recent[1])
                else:
                    self._ensure_subscribed(channel)
            entry.waiters += 1
            return entry

    def _unregister(self, task_id: str, entry: _Pending) -> None:
        with self.lock:
            entry.waiters -= 1
            if entry.waiters == 0 and self._pending.get(task_id) is entry:
                del self._pending[task_id]

    def _ensure_subscribed(self, channel: str) -> None:
        """Called with the lock held."""
        node = self._node_of.get(channel)
        if node is None:
            node = self._node_for(channel)
            self._node_of[channel] = node
            node.subscribe(channel)

    def _node_for(self, channel: str) -> _Node:
        if self.cluster:
            found = self.client.get_node_from_key(channel)
            address = (str(found.host), int(found.port))
        else:
            kwargs = self._connection_kwargs
            address = (str(kwargs.get("host", "localhost")), int(kwargs.get("port", 6379)))
        node = self._nodes.get(address)
        if node is None:
            node = self._nodes[address] = _Node(self, *address)
        return node

    # --- the listener threads --------------------------------------------------------------
    def deliver_message(self, data: bytes) -> None:
        task_id_raw, _, payload = data.partition(b" ")
        task_id = task_id_raw.decode()
        if is_delta(payload):
            with self.lock:
                self._recent_deltas.keep(task_id, payload, time.monotonic())
                entry = self._pending.get(task_id)
                if entry is not None and entry.feeds:
                    deltas = parse_deltas(payload)
                    for feed in entry.feeds:
                        feed.add(task_id, deltas)
            return
        with self.lock:
            # Kept for a waiter yet to register: one whose append returned just before the
            # result came, or one that registers after the others of its batch are gone.
            self._keep_recent(task_id, payload)
            entry = self._pending.get(task_id)
            if entry is not None and not entry.event.is_set():
                self._set_meta(entry, payload)

    def _keep_recent(self, task_id: str, payload: bytes) -> None:
        now = time.monotonic()
        self._recent[task_id] = (now, payload)
        while self._recent:
            _, (arrived, _) = next(iter(self._recent.items()))
            if now - arrived <= RECENT_RESULTS_S:
                break
            self._recent.popitem(last=False)

    def _set_meta(self, entry: _Pending, payload: bytes) -> None:
        meta = self.backend.decode(payload)
        if meta.get("status") in states.READY_STATES:
            entry.meta = meta
            entry.done()

    def check_stored(self, channel: str) -> None:
        """A subscription took effect: read the stored result of every id waiting on the
        channel, which covers a result published before it."""
        with self.lock:
            waiting = [tid for tid in self._pending if results_channel(tid) == channel]
        for task_id in waiting:
            try:
                payload = self.client.get(self._prefix + task_id)
            except REDIS_FAULTS as exc:
                log.warning("result listener: cannot read result %s: %s", task_id, exc)
                continue
            if payload is not None:
                with self.lock:
                    entry = self._pending.get(task_id)
                    if entry is not None and not entry.event.is_set():
                        self._set_meta(entry, payload)

    def fail_pending(self, channels: set[str]) -> None:
        """The node of `channels` is unreachable: every wait on them ends now."""
        with self.lock:
            for task_id, entry in self._pending.items():
                if not entry.event.is_set() and results_channel(task_id) in channels:
                    entry.lost = True
                    entry.done()

    def resubscribe(self, channel: str, old: _Node) -> None:
        with self.lock:
            old.channels.discard(channel)
            self._node_of.pop(channel, None)
            try:
                self.client.nodes_manager.initialize()
            except Exception as exc:  # noqa: BLE001 - the next wait on the channel tries again
                log.warning("result listener: cannot refresh the cluster's slots: %s", exc)
            self._ensure_subscribed(channel)


_listeners: dict[tuple[int, int], ResultListener] = {}
_listeners_lock = threading.Lock()


def listener_for(backend: SharedListenerRedisBackend) -> ResultListener:
    """The listener of this process and backend (a forked child gets its own)."""
    key = (os.getpid(), id(backend))
    listener = _listeners.get(key)
    if listener is None:
        with _listeners_lock:
            listener = _listeners.get(key)
            if listener is None:
                listener = _listeners[key] = ResultListener(backend)
    return listener


class SharedListenerRedisBackend(RedisBackend):
    """Celery's Redis result backend with every wait routed through the process's listener,
    and every store published on the task's shard channel.

    Celery builds one backend per thread (per greenlet under gevent), at about 0.5 ms each;
    the instance here is shared per process and URL, which is safe because nothing of the
    stock per-thread pub/sub consumer is used. With the transport option `cluster` (settings:
    SAMPLING_REDIS_CLUSTER) its URL is a seed node of a Redis cluster.
    """

    _instances: dict[tuple[int, int, str | None], SharedListenerRedisBackend] = {}
    _instances_lock = threading.Lock()
    _initialised: bool
    listener_url: str
    url: str | None  # set by RedisBackend.__init__

    def __new__(cls, app: Any = None, url: str | None = None, **kwargs: Any) -> Any:
        key = (os.getpid(), id(app), url)
        with cls._instances_lock:
            instance = cls._instances.get(key)
            if instance is None:
                instance = cls._instances[key] = super().__new__(cls)
                instance._initialised = False
        return instance

    def __init__(self, app: Any = None, url: str | None = None, **kwargs: Any) -> None:
        if self._initialised:
            return
        super().__init__(app=app, url=url, **kwargs)
        self.listener_url = url or self.url or "redis://127.0.0.1:6379/0"
        app_conf = self.app.conf  # type: ignore[attr-defined]  # set by Backend.__init__
        options = app_conf.get("result_backend_transport_options") or {}
        self.cluster = bool(options.get("cluster", False))
        self._initialised = True

    @cached_property
    def client(self) -> Any:  # RedisBackend's is a cached_property too
        if self.cluster:
            return redis_client(self.listener_url, cluster=True)
        return super().client

    @property
    def listener(self) -> ResultListener:
        return listener_for(self)

    def _set(self, key: str, value: bytes | str, expires: float | None = None) -> None:
        # Celery's store path (store_result, mark_as_failure): as a worker stores answers.
        key_text = key.decode() if isinstance(key, bytes) else key
        task_id = key_text[len(key_prefix(self)) :]
        with self.client.pipeline(transaction=False) as pipe:
            queue_store(pipe, self, task_id, value, expires)
            pipe.execute()

    # The stock consumer would subscribe the sending thread to every task it sends (celery
    # #3808) and start a drainer per thread: neither is wanted.
    def on_task_call(self, producer: Any, task_id: str) -> None:
        return None

    def add_pending_result(
        self, result: Any, weak: bool = False, start_drainer: bool = True
    ) -> Any:
        return result

    def remove_pending_result(self, result: Any) -> Any:
        return result

    def wait_for_pending(
        self,
        result: Any,
        timeout: float | None = None,
        interval: float = 0.5,
        no_ack: bool = True,
        on_message: Any = None,
        on_interval: Any = None,
        callback: Any = None,
        propagate: bool = True,
    ) -> Any:
        self._ensure_not_eager()  # type: ignore[attr-defined]  # celery-types lacks it
        meta = self.listener.wait(result.id, timeout)
        result._maybe_set_cache(meta)
        return result.maybe_throw(callback=callback, propagate=propagate)
