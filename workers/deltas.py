"""A call's streaming rows' new text, published while the call runs (batching.deltas).

The sampler hands each streaming row's new text to `sink` as it decodes it (from the GPU
thread, between two steps); a thread of the publisher's own sends what has gathered at once
when the last message went `interval_ms` ago or more (a call's first text goes as soon as it
is sampled), else once that long has passed: one PUBLISH for the whole batch, so that Redis
sees about
call/interval messages per call whatever the rows and tokens; with each, it reads which items'
clients left (ShardKeys.cancelled), whose text it publishes no more. Nothing here can fail
the call: a publish that fails is logged once and the deltas dropped (the answers carry the
whole text).
"""

from __future__ import annotations

import logging
import threading
import time
from types import TracebackType

import redis

from batching.deltas import Delta, delta_message
from batching.keys import results_channel
from batching.topology import is_cluster

log = logging.getLogger(__name__)

# The call's end waits this long at most for its last deltas to go: a slow Redis must not
# hold the worker (the answers carry the whole text; later deltas of it are dropped).
EXIT_WAIT_S = 0.5


class DeltaPublisher:
    """For one call of batch `batch_id`: `sink(row, text)` gathers, a thread publishes. The
    row is the call's row index; `items[row]` is its item index in the batch."""

    def __init__(
        self,
        client: redis.Redis,
        batch_id: str,
        items: list[int],
        interval_ms: float,
        cancelled_key: str = "",
    ) -> None:
        """`cancelled_key`: the set of the batch's items whose client left, read with each
        publish: their text stops from the next one on."""
        self.client = client
        self.cancelled_key = cancelled_key
        self.cancelled: set[int] = set()
        self.batch_id = batch_id
        self.items = items
        self.interval_s = interval_ms / 1000
        self.channel = results_channel(batch_id)
        self.command = "SPUBLISH" if is_cluster(client) else "PUBLISH"
        self.published = 0  # messages
        self._gathered: dict[int, str] = {}
        self._tokens: dict[int, tuple[int, int]] = {}  # item -> its tokens at its last text
        self._offsets: dict[int, int] = {}  # item -> characters of its text published
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # text was gathered
        self._last = float("-inf")  # monotonic time of the last publish
        self._failed = False
        self._thread = threading.Thread(target=self._run, name=f"deltas-{batch_id}", daemon=True)

    def sink(self, row: int, text: str, tokens: tuple[int, int] | None = None) -> bool:
        """Gathers the row's text; True once its client has left (as the last publish read)."""
        item = self.items[row]
        if item in self.cancelled:
            return True
        with self._lock:
            self._gathered[item] = self._gathered.get(item, "") + text
            if tokens is not None:
                self._tokens[item] = tokens
        self._wake.set()
        return False

    def __enter__(self) -> DeltaPublisher:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """The call ended: what is still gathered goes now, before the answers are stored,
        unless Redis takes longer than EXIT_WAIT_S to take it."""
        self._stop.set()
        self._wake.set()
        self._thread.join(EXIT_WAIT_S)
        if self._thread.is_alive():
            log.warning("batch %s: last deltas still not published after %g s; the answers "
                        "carry the whole text", self.batch_id, EXIT_WAIT_S)  # fmt: skip

    def _run(self) -> None:
        while True:
            self._wake.wait()
            # Cleared before the stop is read: the end's wake-up, set after this, is never
            # lost (cleared after it, the thread waited for good and the call never ended).
            self._wake.clear()
            if self._stop.is_set():
                break
            wait_s = self._last + self.interval_s - time.monotonic()
            if wait_s > 0 and self._stop.wait(wait_s):
                break
            self._last = time.monotonic()
            self.flush()
        self.flush()  # what the call gathered last

    def flush(self) -> None:
        with self._lock:
            gathered, self._gathered = self._gathered, {}
            tokens = dict(self._tokens)
        gathered = {item: text for item, text in gathered.items() if item not in self.cancelled}
        if not gathered:
            return
        deltas = {}
        for item, text in gathered.items():
            offset = self._offsets.get(item, 0)
            deltas[item] = Delta(offset, text, *tokens.get(item, (None, None)))
            self._offsets[item] = offset + len(text)
        try:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.execute_command(
                    self.command, self.channel, delta_message(self.batch_id, deltas)
                )
                if self.cancelled_key:
                    pipe.smembers(self.cancelled_key)
                replies = pipe.execute()
            self.published += 1
            if self.cancelled_key:
                self.cancelled.update(int(item) for item in replies[1])
        except Exception as exc:  # noqa: BLE001 - deltas are an early view: never fail a call
            if not self._failed:
                log.warning("batch %s: deltas not published: %s", self.batch_id, exc)
                self._failed = True
