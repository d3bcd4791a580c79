"""What a stream its client cuts is charged: a priced model whose 2 s simulated calls stream
their words one by one, a keyed client on a raw socket that reads a few chunks and then
half-closes its side (the server sees it leave, and what it still writes is read to the end).
Its key's usage in /v1/usage is exactly the prompt's tokens and the words it was sent, at the
model's prices. Keys are required: a web process that has not read a new key yet answers 401
and the request is sent again (without, it served the key's request as anonymous)."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from decimal import Decimal

import pytest

from devstack.stack import Stack
from tests.support import unique_queue
from tests.support.batches import (
    COMPLETION_PRICE,
    PROMPT_PRICE,
    new_key,
    priced_stack,
    usage_of,
)
from tests.support.keys import once_known
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

CALL_MS = 2000
WORDS = 40  # extra words: the first 32 of them come about every 60 ms of the call
READ_BEFORE_LEAVING = 3  # content chunks


@pytest.fixture(scope="module")
def model() -> str:
    return unique_queue("stream-charges")


@pytest.fixture(scope="module")
def stack(
    start_stack: Callable[..., Stack], model: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    yield from priced_stack(
        start_stack, "stream-charges", model, tmp_path_factory.mktemp("files"),
        SIMULATED_BATCH_MS=str(CALL_MS), SIMULATED_EXTRA_WORDS=str(WORDS),
        SAMPLING_DEADLINE_MS="8000", SAMPLING_STREAM_INTERVAL_MS="1",
        SAMPLING_REQUIRE_API_KEY="1",
    )  # fmt: skip


def cut_stream(stack: Stack, key: str, body: dict[str, object]) -> str | None:
    """The text a streamed completion sent to a client that read READ_BEFORE_LEAVING content
    chunks and then closed its side of the connection (reading on to the end); None for a 401
    (a web process that has not read the key yet)."""
    payload = json.dumps({**body, "stream": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    texts: list[str] = []
    received = b""
    with socket.create_connection(("127.0.0.1", stack.port), timeout=30) as connection:
        connection.sendall(head.encode() + payload)
        left = False
        while chunk := connection.recv(65536):
            received += chunk
            if received.startswith(b"HTTP/1.1 401 "):
                return None
            texts = _texts(received)
            if not left and len(texts) >= READ_BEFORE_LEAVING:
                connection.shutdown(socket.SHUT_WR)  # gone, as far as the server can tell
                left = True
    assert left, received[-500:]
    assert b"[DONE]" not in received  # cut, not whole
    return "".join(texts)


def _texts(received: bytes) -> list[str]:
    """The content of every whole SSE event in a chunked response read so far."""
    texts = []
    for line in received.split(b"\n"):
        if line.startswith(b"data: {"):
            try:
                event = json.loads(line[len(b"data: ") :])
            except ValueError:  # cut in the middle: the rest comes
                continue
            texts += [choice["text"] for choice in event.get("choices", []) if choice["text"]]
    return texts


def test_a_cut_stream_is_charged_what_it_delivered(stack: Stack, model: str) -> None:
    body = {"model": model, "prompt": "a stream cut short", "max_tokens": 32}
    _, _, probe = new_key(stack)
    create = probe.completions.create
    whole = once_known(lambda: create(**body))  # type: ignore[call-overload]
    assert whole.usage is not None
    _, secret, _ = new_key(stack)
    sent = wait_until(lambda: cut_stream(stack, secret, body), what="the stream keyed")
    assert sent is not None
    words = len(sent.split())
    assert whole.choices[0].text.startswith(sent)
    assert 0 < words < whole.usage.completion_tokens
    prompt = whole.usage.prompt_tokens
    spend = (prompt * PROMPT_PRICE + words * COMPLETION_PRICE) / 1000
    expected = {"prompt_tokens": prompt, "completion_tokens": words, "spend": spend}

    def charged() -> dict[str, object]:
        usage = usage_of(stack, secret, model)
        return {name: usage.get(name) for name in expected}

    try:
        wait_until(lambda: charged() == expected, timeout_s=30, what="the cut stream charged")
    except AssertionError:
        assert charged() == expected  # says by how much
    assert isinstance(expected["spend"], Decimal)
