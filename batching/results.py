"""Exact, cheap waiting on Celery results: one pub/sub listener per process.

Stock Celery 5.x waits on the Redis backend in 1 s steps, wakes one waiter per task id per
backend, and holds a pub/sub connection per thread (per greenlet under gevent). Here every
wait of a process goes through one ResultListener: one pub/sub connection and one thread (a
greenlet under gevent) that wakes every local waiter of a batch at once. The view keeps
Celery's API, `app.AsyncResult(batch_id).get(timeout=...)`, because
SharedListenerRedisBackend is the configured result backend (CELERY_RESULT_BACKEND).

docs/result-waiting.md has the measurements behind this design: stock `get(timeout=0.5)`
returned after about 1.02 s, and under gevent each greenlet got its own backend, pub/sub
connection and drainer.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import redis
from celery import states
from celery.backends.redis import RedisBackend
from celery.exceptions import TimeoutError as CeleryTimeoutError

log = logging.getLogger(__name__)

# How long the pub/sub connection may stay silent before it is PINGed, and declared dead
# after a second silent period.
HEALTH_INTERVAL_S = 5.0


class _Pending:
    __slots__ = ("event", "meta", "waiters")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.meta: dict[str, Any] | None = None
        self.waiters = 0


class ResultListener:
    """One pub/sub connection per process, subscribed to the result channels waited on here.

    A waiter registers its task id (the first waiter of an id subscribes), then waits on an
    event with its remaining time. When Redis confirms a subscription the listener reads the
    stored result once, which covers a result published before the subscription took effect.
    After a reconnect every pending id is subscribed, and so re-read, again.
    """

    def __init__(self, url: str, backend: RedisBackend) -> None:
        self.url = url
        self.backend = backend
        self.client = redis.Redis.from_url(url)
        # RESP2: pub/sub messages arrive as plain replies (redis-py 8 defaults to RESP3, where
        # they are push frames that read_response() hands to a push handler instead).
        self._pool = redis.ConnectionPool.from_url(
            url, protocol=2, socket_timeout=None, socket_keepalive=True
        )
        self._lock = threading.Lock()  # guards _pending and every write to _conn
        self._pending: dict[str, _Pending] = {}
        self._conn: redis.Connection | None = None
        self._thread: threading.Thread | None = None
        key: str | bytes = backend.get_key_for_task("x")  # bytes at run time, str in the stubs
        self._prefix = (key.decode() if isinstance(key, bytes) else key)[:-1]  # celery-task-meta-

    # --- waiting (any thread) ------------------------------------------------------------
    def wait(self, task_id: str, timeout: float | None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        entry = self._register(task_id)
        try:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not entry.event.wait(remaining):
                raise CeleryTimeoutError("The operation timed out.")
            assert entry.meta is not None
            return dict(entry.meta)
        finally:
            self._unregister(task_id, entry)

    def pending_count(self) -> int:
        return len(self._pending)

    def _register(self, task_id: str) -> _Pending:
        with self._lock:
            self.ensure_started()
            entry = self._pending.get(task_id)
            if entry is None:
                entry = self._pending[task_id] = _Pending()
                self._send("SUBSCRIBE", self._prefix + task_id)
            entry.waiters += 1
            return entry

    def _unregister(self, task_id: str, entry: _Pending) -> None:
        with self._lock:
            entry.waiters -= 1
            if entry.waiters == 0 and self._pending.get(task_id) is entry:
                del self._pending[task_id]
                self._send("UNSUBSCRIBE", self._prefix + task_id)

    def _send(self, *command: str) -> None:
        # Called with _lock held. A command lost with a dying connection is harmless: the
        # reconnect subscribes every pending id again.
        if self._conn is None:
            return
        try:
            self._conn.send_command(*command, check_health=False)
        except (redis.ConnectionError, OSError) as exc:
            log.warning("result listener: %s failed: %s", command[0], exc)

    def ensure_started(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="result-listener", daemon=True)
            self._thread.start()

    # --- listening (the listener thread) -------------------------------------------------
    def _run(self) -> None:
        backoff = 0.05
        while True:
            conn = self._pool.make_connection()
            try:
                conn.connect()
                with self._lock:
                    self._conn = conn
                    channels = [self._prefix + task_id for task_id in self._pending]
                    if channels:
                        conn.send_command("SUBSCRIBE", *channels, check_health=False)
                backoff = 0.05
                self._listen(conn)
            except Exception as exc:  # noqa: BLE001 - reconnect on anything; waiters time out meanwhile
                log.warning("result listener: connection lost (%s), reconnecting", exc)
            finally:
                with self._lock:
                    self._conn = None
                conn.disconnect()
            time.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    def _listen(self, conn: redis.Connection) -> None:
        silent_periods = 0
        while True:
            if not conn.can_read(timeout=HEALTH_INTERVAL_S):
                silent_periods += 1
                if silent_periods >= 2:
                    raise redis.ConnectionError("no answer to PING")
                with self._lock:
                    conn.send_command("PING", check_health=False)
                continue
            silent_periods = 0
            reply = conn.read_response()
            if not isinstance(reply, list) or len(reply) < 2:
                continue  # +PONG outside subscribed mode
            kind = reply[0]
            if kind == b"message":
                self._deliver(reply[1].decode(), reply[2])
            elif kind == b"subscribe":
                self._check_stored(reply[1].decode())

    def _check_stored(self, channel: str) -> None:
        task_id = channel[len(self._prefix) :]
        if task_id not in self._pending:
            return
        payload = self.client.get(channel)
        if payload is not None:
            self._deliver(channel, payload)

    def _deliver(self, channel: str, payload: bytes) -> None:
        task_id = channel[len(self._prefix) :]
        entry = self._pending.get(task_id)
        if entry is None or entry.event.is_set():
            return
        meta = self.backend.decode(payload)
        if meta.get("status") not in states.READY_STATES:
            return
        entry.meta = meta
        entry.event.set()


def queue_success(
    pipe: redis.client.Pipeline, backend: RedisBackend, task_id: str, result: Any
) -> None:
    """Queue on `pipe` what Celery's Redis backend runs to store a task's success: the SET of
    its key (with the results' expiry) and the PUBLISH on the key's channel, in the backend's
    own encoding, so that `AsyncResult(task_id).get()` reads it as any stored result.

    Sent in a pipeline of the caller's (a worker sends a batch's answers in the round trip
    that seals its next batch), and without the GET by which `store_result` first checks for
    a stored success: a sealed batch is answered once.
    """
    encoded = backend.encode_result(result, states.SUCCESS)
    # Celery's own meta (status, result, traceback, children, date_done, and the extended
    # fields when result_extended is on): the one private name used here, as stable as the
    # format it builds.
    meta = backend._get_result_meta(  # type: ignore[attr-defined]
        result=encoded, state=states.SUCCESS, traceback=None, request=None
    )
    meta["task_id"] = task_id
    key = backend.get_key_for_task(task_id)
    value = backend.encode(meta)
    expires = backend.expires  # type: ignore[attr-defined]  # set by KeyValueStoreBackend
    if expires:
        pipe.set(key, value, ex=expires)
    else:
        pipe.set(key, value)
    pipe.publish(key, value)


_listeners: dict[tuple[int, str], ResultListener] = {}
_listeners_lock = threading.Lock()


def listener_for(url: str, backend: RedisBackend) -> ResultListener:
    """The listener of this process (a forked child gets its own)."""
    key = (os.getpid(), url)
    listener = _listeners.get(key)
    if listener is None:
        with _listeners_lock:
            listener = _listeners.get(key)
            if listener is None:
                listener = _listeners[key] = ResultListener(url, backend)
    return listener


class SharedListenerRedisBackend(RedisBackend):
    """Celery's Redis result backend with every wait routed through the process's listener.

    Celery builds one backend per thread (per greenlet under gevent), at about 0.5 ms each;
    the instance here is shared per process and URL, which is safe because nothing of the
    stock per-thread pub/sub consumer is used.
    """

    _instances: dict[tuple[int, int, str | None], SharedListenerRedisBackend] = {}
    _instances_lock = threading.Lock()
    _initialised: bool
    _listener_url: str
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
        self._listener_url = url or self.url or "redis://127.0.0.1:6379/0"
        self._initialised = True

    @property
    def listener(self) -> ResultListener:
        return listener_for(self._listener_url, self)

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
