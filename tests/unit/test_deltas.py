"""A streaming batch's deltas: the item's mark, the message's codec, the worker's coalescing
publisher (against a real Redis) and a web process's feed of them."""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from typing import Any

import pytest
import redis

from batching.deltas import Delta, Feed, delta_message, is_delta, parse_deltas
from batching.generation import SampleRequest
from batching.items import item_of, parse_item
from batching.keys import ShardKeys, results_channel
from devstack.embedded_redis import EmbeddedRedis
from tests.support.waiting import wait_until
from workers.deltas import EXIT_WAIT_S, DeltaPublisher


@pytest.mark.parametrize(("key_id", "cache"), [(0, ""), (7, ""), (7, "ab12cd")])
@pytest.mark.parametrize("prompt", ["a bare prompt: with a colon", SampleRequest(prompt="p: x")])
def test_an_item_says_whether_it_streams(
    key_id: int, cache: str, prompt: str | SampleRequest
) -> None:
    for stream, deadline_ms in itertools.product((False, True), (0, 500)):
        raw = item_of(1234, prompt, key_id, cache, stream, deadline_ms).encode()
        item = parse_item(raw)
        assert (item.expires_at_ms, item.key_id, item.cache, item.stream) == (
            1234, key_id, cache, stream,
        )  # fmt: skip
        assert item.request_deadline_ms == deadline_ms
        assert item.request == (prompt if isinstance(prompt, SampleRequest) else None)
        assert raw.startswith(b"1234")  # batching/lua/seal.lua reads the expiry's digits


def test_a_delta_message_round_trips_and_is_told_from_an_answer() -> None:
    deltas = {0: Delta(0, " naïve", 7, 2), 17: Delta(12, " 東京 🚀")}
    message = delta_message("b-1", deltas)
    task_id, _, payload = message.partition(b" ")
    assert task_id == b"b-1"
    assert is_delta(payload)
    assert parse_deltas(payload) == deltas
    # An older worker's message: the text alone, its tokens not counted.
    assert parse_deltas(b'delta {"3": [4, "text"]}') == {3: Delta(4, "text")}
    # One that is no delta message is none (its items' answers bring their text).
    for broken in (b"delta [1]", b'delta {"3": [4]}', b'delta {"x": [4, "a"]}', b"delta {"):
        assert parse_deltas(broken) == {}
    assert not is_delta(b'{"status": "SUCCESS"}')


def _subscribed(redis_client: redis.Redis, channel: str) -> redis.client.PubSub:
    pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(channel)
    wait_until(lambda: redis_client.pubsub_numsub(channel)[0][1] == 1, timeout_s=5)
    return pubsub


def _received(pubsub: redis.client.PubSub, count: int) -> list[dict[int, Delta]]:
    """The deltas of the first `count` messages on the channel."""
    found: list[dict[int, Delta]] = []
    give_up = time.monotonic() + 5
    while len(found) < count and time.monotonic() < give_up:
        message = pubsub.get_message(timeout=0.2)  # None also for a subscription's reply
        if message is not None:
            found.append(parse_deltas(message["data"].partition(b" ")[2]))
    return found


def test_the_publisher_coalesces_a_calls_text_into_a_message_per_interval(
    redis_client: redis.Redis,
) -> None:
    batch_id = ShardKeys(uuid.uuid4().hex[:8]).batch_id("x1")
    pubsub = _subscribed(redis_client, results_channel(batch_id))
    words = [f" w{k}" for k in range(40)]
    started = time.monotonic()
    # Rows 0 and 1 of the call are the batch's items 5 and 2.
    with DeltaPublisher(redis_client, batch_id, [5, 2], interval_ms=20) as publisher:
        for count, word in enumerate(words, 1):
            publisher.sink(0, word, (3, count))  # row 0's sampler counts its tokens
            publisher.sink(1, word.upper())
            time.sleep(0.002)  # duration: a sampler's pace, one token every 2 ms (the input)
    elapsed_ms = (time.monotonic() - started) * 1000
    messages = _received(pubsub, publisher.published)
    for item, text in ((5, "".join(words)), (2, "".join(words).upper())):
        pieces = [m[item] for m in messages if item in m]
        assert "".join(piece.text for piece in pieces) == text
        # Each piece says where it goes: after all the item's text before it.
        assert [piece.offset for piece in pieces] == list(
            itertools.accumulate([len(piece.text) for piece in pieces[:-1]], initial=0)
        )
    counted = [m[5] for m in messages if 5 in m]
    assert (counted[-1].prompt_tokens, counted[-1].completion_tokens) == (3, len(words))
    assert all(m[2].completion_tokens is None for m in messages if 2 in m)
    # One message per interval at most (and one at the end), whatever the rows and tokens.
    assert pubsub.get_message(timeout=0.1) is None  # and no other
    assert 2 <= len(messages) <= elapsed_ms / 20 + 2


class _EndsAfterTheCheck(threading.Event):
    """The publisher's stop, whose first read lets the call end (as __exit__ signals) just
    after the thread found it not set: the moment a busy machine can preempt it at."""

    def __init__(self, wake: threading.Event) -> None:
        super().__init__()
        self.wake = wake
        self.read = False

    def is_set(self) -> bool:
        found = super().is_set()
        if not self.read:
            self.read = True
            self.set()
            self.wake.set()
        return found


def test_a_call_that_ends_while_its_publisher_publishes_is_never_waited_for(
    redis_client: redis.Redis,
) -> None:
    """The end's wake-up lands between the thread's read of the stop and its next wait: the
    thread still ends (it waited for good, the call never ended, and the worker's watchdog
    took it for a hung GPU)."""
    batch_id = ShardKeys(uuid.uuid4().hex[:8]).batch_id("x2")
    publisher = DeltaPublisher(redis_client, batch_id, [0], interval_ms=5)
    publisher._stop = _EndsAfterTheCheck(publisher._wake)
    publisher.__enter__()
    publisher.sink(0, " text")
    publisher._thread.join(timeout=5)
    assert not publisher._thread.is_alive()
    publisher.__exit__(None, None, None)
    assert publisher.published >= 1


# Redis answers no command for this long: far past the publisher's wait at a call's end.
PAUSE_MS = 4000


def test_a_call_that_ends_while_redis_is_slow_waits_for_its_deltas_a_bounded_time() -> None:
    """A slow Redis at a call's end (paused here) holds the call's end EXIT_WAIT_S at most:
    the worker's watchdog took the wait for a hung GPU and ended the worker."""
    server = EmbeddedRedis().start()
    try:
        client = redis.Redis.from_url(server.url)
        batch_id = ShardKeys(uuid.uuid4().hex[:8]).batch_id("x3")
        publisher = DeltaPublisher(client, batch_id, [0], interval_ms=5).__enter__()
        publisher.sink(0, " first")
        wait_until(lambda: publisher.published == 1, what="the first delta")
        redis.Redis.from_url(server.url).client_pause(PAUSE_MS)
        publisher.sink(0, " last")
        began = time.monotonic()
        publisher.__exit__(None, None, None)
        waited_s = time.monotonic() - began
        # Bounded by the wait and a thread's scheduling on a busy machine, not by the pause.
        assert waited_s < EXIT_WAIT_S + (PAUSE_MS / 1000 - EXIT_WAIT_S) / 2, waited_s
        publisher._thread.join(timeout=10)  # its last publish, once Redis answers: not a leak
    finally:
        server.stop()


def test_a_publisher_that_cannot_publish_never_fails_the_call() -> None:
    unreachable = redis.Redis(port=1, socket_connect_timeout=0.2)
    with DeltaPublisher(unreachable, "b-x", [0], interval_ms=5) as publisher:
        publisher.sink(0, "lost")
    # Its thread may outlive the call by its last try: done before the next test, whose logs
    # it would write into.
    publisher._thread.join(timeout=10)
    assert not publisher._thread.is_alive()
    assert publisher.published == 0


class _Wait:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.meta: dict[str, Any] | None = None
        self.lost = False


def test_a_feed_hands_over_deltas_in_order_and_its_batches_answers() -> None:
    feed = Feed()
    wait = feed.waits["b-1"] = _Wait()
    assert not feed.wait(0.01)
    feed.add("b-1", {0: Delta(0, "one")})
    feed.add("b-1", {0: Delta(3, " two")})
    assert feed.wait(0)
    assert feed.take() == [("b-1", {0: Delta(0, "one")}), ("b-1", {0: Delta(3, " two")})]
    assert not feed.event.is_set()
    assert feed.answers("b-1") is None
    wait.meta = {"status": "SUCCESS"}
    wait.event.set()
    assert feed.answers("b-1") == {"status": "SUCCESS"}
    wait.lost = True
    with pytest.raises(LookupError):
        feed.answers("b-1")
