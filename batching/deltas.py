"""A streaming batch's new text on its way from its worker to the requests that stream it.

While a call has streaming rows, its worker publishes their new text at most once every
SAMPLING_STREAM_INTERVAL_MS (workers.deltas), one message for the whole batch, on the batch's
shard's results channel: the channel its answers go on, to which every web process waiting
on the shard listens already. A message is the batch id, a space, DELTA_MARK, then JSON
{item index: [offset, new text, prompt tokens, completion tokens]}: the offset is how many
characters of the item's text earlier messages carried; the tokens are the item's so far
(null where its sampler does not count them; older workers send the first two alone). Each
web process's ResultListener hands it to the feeds open on the batch (one per streaming
request waiting on it) and drops it when there is none.

Deltas are an early view only: the batch's answers carry every item's whole text, and a
stream sends what its deltas left out of it (batching.streaming: the deltas, joined, are
always a prefix of the final text). A delta lost (published while a web process
reconnects, say) shows as a gap in the offsets: the stream sends no more of that item's
deltas, and its answer brings the rest. It costs a moment and nothing more.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

# SAMPLING_STREAM_INTERVAL_MS's default: at most one delta message per batch this often, so
# a 100 ms call shows about 10 deltas, and a call's first text goes out within this long of
# its sampling.
STREAM_INTERVAL_MS = 10
# What starts a delta message's payload, after the batch id and its space: a stored result's
# payload is Celery's JSON meta, which starts with "{".
DELTA_MARK = b"delta "


class Delta(NamedTuple):
    """An item's new text: characters of its text sent before it, the text, and the item's
    tokens with it (None: not counted)."""

    offset: int
    text: str
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


def delta_message(task_id: str, deltas: Mapping[int, Delta]) -> bytes:
    """The message that carries a batch's new text, {item index: Delta}."""
    body = json.dumps({str(index): list(delta) for index, delta in deltas.items()},
                      ensure_ascii=False)  # fmt: skip
    return task_id.encode() + b" " + DELTA_MARK + body.encode()


def is_delta(payload: bytes) -> bool:
    return payload.startswith(DELTA_MARK)


def parse_deltas(payload: bytes) -> dict[int, Delta]:
    """{item index: Delta} of a delta message's payload (after the batch id and its space);
    none of a message that is not one (dropped: its items' answers bring their text)."""
    try:
        raw = json.loads(payload[len(DELTA_MARK) :])
        return {int(index): _delta(*values) for index, values in raw.items()}
    except (ValueError, TypeError, AttributeError):
        return {}


def _delta(offset: Any, text: Any, prompt: Any = None, completion: Any = None) -> Delta:
    if prompt is None or completion is None:
        return Delta(int(offset), str(text))
    return Delta(int(offset), str(text), int(prompt), int(completion))


class Waited(Protocol):
    """A batch's wait in the listener (batching.results): set once its answers are in (`meta`),
    or once they cannot come (`lost`)."""

    event: threading.Event
    meta: dict[str, Any] | None
    lost: bool


class Feed:
    """One streaming request's view of the batches it joined: their deltas as they come, and a
    wake-up when one of them is answered. Made and closed by ResultListener.open_feed and
    close_feed; read by one request (a greenlet), written by the listener's threads."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.waits: dict[str, Waited] = {}  # batch id -> its wait
        self._deltas: list[tuple[str, dict[int, Delta]]] = []

    def add(self, task_id: str, deltas: dict[int, Delta]) -> None:
        self._deltas.append((task_id, deltas))
        self.event.set()

    def wake(self) -> None:
        self.event.set()

    def wait(self, timeout: float) -> bool:
        """Whether something came (a delta, an answer) within `timeout` s."""
        return self.event.wait(timeout)

    def take(self) -> list[tuple[str, dict[int, Delta]]]:
        """The deltas that came since the last take, oldest first."""
        self.event.clear()
        taken, self._deltas = self._deltas, []
        return taken

    def answers(self, task_id: str) -> dict[str, Any] | None:
        """The batch's stored meta once it is answered, else None. Raises LookupError when
        its answers cannot come (its Redis node is down)."""
        waited = self.waits[task_id]
        if not waited.event.is_set():
            return None
        if waited.lost:
            raise LookupError(task_id)
        return waited.meta


class RecentDeltas:
    """The delta messages of the last `keep_s` seconds, raw, by batch: a stream whose feed
    opens after its batch's call began (its request's greenlet resumed late after the join)
    still gets them from the start. Only streaming batches send any."""

    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        self._kept: OrderedDict[str, tuple[float, list[bytes]]] = OrderedDict()

    def keep(self, task_id: str, payload: bytes, now: float) -> None:
        found = self._kept.get(task_id)
        if found is None:
            self._kept[task_id] = (now, [payload])
        else:
            found[1].append(payload)
        while self._kept:
            first, _ = next(iter(self._kept.values()))
            if now - first <= self.keep_s:
                break
            self._kept.popitem(last=False)

    def of(self, task_id: str) -> list[bytes]:
        found = self._kept.get(task_id)
        return list(found[1]) if found is not None else []
