"""An offline job's line: read and checked as its endpoint checks a request, and its answer
shaped as the endpoint answers."""

from __future__ import annotations

import json

import pytest

from batching.answers import Answer
from batching.outcomes import ItemOutcome
from batching.policy import Policy
from offline.lines import CHAT, COMPLETIONS, BadLine, answered, read_line, refused, request_of
from sampling.responses import Invalid


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
