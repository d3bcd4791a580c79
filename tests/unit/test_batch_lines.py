"""An offline job's line: read and checked as its endpoint checks a request, and its answer
shaped as the endpoint answers."""

from __future__ import annotations

import io
import json

import pytest

from batching.answers import Answer
from batching.outcomes import ItemOutcome
from batching.policy import Policy
from offline.lines import (
    CHAT,
    COMPLETIONS,
    MAX_LINE_DEPTH,
    BadLine,
    UnreadableLine,
    answered,
    count_lines,
    raw_lines,
    read_line,
    refused,
    request_of,
)
from serving.responses import Invalid


def _raw(**fields: object) -> bytes:
    line = {"custom_id": "c-1", "method": "POST", "url": CHAT,
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}  # fmt: skip
    return json.dumps({**line, **fields}).encode()


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (_raw(custom_id=""), "custom_id"),
        (_raw(method="GET"), "method must be POST"),
        (_raw(url=COMPLETIONS), "url must be the batch's endpoint"),
        (_raw(body={"messages": []}), "body must be an object with a model"),
    ],
)
def test_a_line_that_is_no_request_of_the_job_says_why(raw: bytes, reason: str) -> None:
    with pytest.raises(BadLine, match=reason) as bad:
        read_line(6, raw, CHAT)
    assert "line 7" in str(bad.value)


def _nested(depth: int) -> object:
    value: object = "hi"
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("raw", "reason", "custom_id"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nests deeper", ""),
        (_raw(body={"model": "m", "messages": _nested(MAX_LINE_DEPTH)}), "nests deeper", "c-1"),
        (b'{"custom_id": "caf\xe9"}', "not UTF-8", ""),
        (_raw(custom_id="c\x00"), "custom_id has a NUL", ""),
        (_raw(body={"model": "m", "messages": [{"role": "user", "content": "a\x00"}]}), "NUL",
         "c-1"),
        (_raw(metadata={"k\x00": 1}), "NUL", "c-1"),
    ],
)  # fmt: skip
def test_a_line_no_request_can_be_read_from_is_its_own_error(
    raw: bytes, reason: str, custom_id: str
) -> None:
    with pytest.raises(UnreadableLine, match=reason) as unread:
        read_line(2, raw, CHAT)
    assert "line 3" in str(unread.value)
    assert unread.value.custom_id == custom_id


def test_a_line_nested_as_deep_as_allowed_is_read() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "x": _nested(60)}
    assert read_line(0, _raw(body=body), CHAT).custom_id == "c-1"


def test_lines_over_the_limit_are_read_through_without_being_held() -> None:
    content = b'{"a": 1}\n\n' + b"x" * 300_000 + b"\n{}\r\n" + b"y" * 50 + b"\n  \nlast"
    read = list(raw_lines(io.BytesIO(content), 100))
    assert read == [(b'{"a": 1}\n', 9), (b"\n", 1), (None, 300_001), (b"{}\r\n", 4),
                    (b"y" * 50 + b"\n", 51), (b"  \n", 3), (b"last", 4)]  # fmt: skip
    assert sum(size for _, size in read) == len(content)
    # A line exactly at the limit, its newline past it, is read.
    assert list(raw_lines(io.BytesIO(b"z" * 100 + b"\n"), 100)) == [(b"z" * 100 + b"\n", 101)]


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 10_000])
def test_lines_counted_in_chunks_are_the_lines_read(chunk: int) -> None:
    content = b'{"a": 1}\n\n  \n{"b": 2}\r\n\t\n{"c": 3}' + b"\n" * 3 + b" x"
    chunks = [content[i : i + chunk] for i in range(0, len(content), chunk)]
    readable = [raw for raw, _ in raw_lines(io.BytesIO(content), 1000) if raw and raw.strip()]
    assert count_lines(chunks) == len(readable) == 4


def test_a_line_is_one_request_with_its_own_settings() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "seed": 7,
            "max_tokens": 5, "temperature": 0.5}  # fmt: skip
    line = read_line(0, _raw(body=body), CHAT)
    request = request_of(line, CHAT, Policy())
    assert (request.seed, request.max_tokens, request.temperature) == (7, 5, 0.5)
    assert request.messages == (("user", "hi"),)


@pytest.mark.parametrize(
    ("changes", "param"),
    [({"n": 2}, "n"), ({"stream": True}, "stream"), ({"temperature": 7}, "temperature")],
)
def test_a_line_its_endpoint_refuses_is_refused_as_it_would_be(
    changes: dict[str, object], param: str
) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **changes}
    with pytest.raises(Invalid) as invalid:
        request_of(read_line(0, _raw(body=body), CHAT), CHAT, Policy())
    status, answer = refused(invalid.value)
    assert status == 400
    assert answer["error"]["param"] == param


def test_an_answer_is_shaped_as_its_endpoint_answers() -> None:
    status, body = answered(CHAT, "m", Answer(ItemOutcome.OK, "hello", "stop", 4, 2))
    assert status == 200
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert body["usage"]["total_tokens"] == 6
    status, body = answered(COMPLETIONS, "m", Answer(ItemOutcome.PROMPT_REJECTED, "too long"))
    assert (status, body["error"]["code"]) == (400, "prompt_rejected")


def test_a_line_may_start_with_a_byte_order_mark() -> None:
    assert read_line(0, b"\xef\xbb\xbf" + _raw(), CHAT).custom_id == "c-1"


def test_a_custom_id_no_database_can_store_is_the_lines_error() -> None:
    with pytest.raises(UnreadableLine, match="lone surrogate") as unread:
        read_line(0, _raw(custom_id="\ud800"), CHAT)
    assert unread.value.custom_id == ""


def test_a_line_of_only_whitespace_over_the_limit_is_blank() -> None:
    content = b" " * 300 + b"\n" + b"\t" * 5 + b"x" * 300 + b"\n"
    assert list(raw_lines(io.BytesIO(content), 100)) == [(b"", 301), (None, 306)]
    assert count_lines([content]) == 1
