"""The shapes of OpenAI's completions and chat completions: a whole answer, or its
Server-Sent Events when `stream` is on.

The batched call returns whole completions, so a stream has, per choice, one content chunk
and its finish chunk (then a usage chunk when `stream_options.include_usage`), and ends with
`data: [DONE]`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from django.http import HttpResponse

from batching.answers import Answer
from sampling import schemas
from sampling.responses import json_response
from sampling.submission import Tokens


def _finish_reason(answer: Answer) -> str:
    # A worker of the version before the API answers [outcome, text]: count such an answer as
    # ended by the model, with no tokens (upgrade the workers before the web processes).
    return answer.finish_reason or "stop"


def _usage(tokens: Tokens) -> dict[str, Any]:
    """Prompt tokens once per prompt (its first choice's count), completion tokens of all, and
    as OpenAI reports them, the prompt tokens answered from the response cache."""
    return {
        "prompt_tokens": tokens.prompt,
        "completion_tokens": tokens.completion,
        "total_tokens": tokens.prompt + tokens.completion,
        "prompt_tokens_details": {"cached_tokens": tokens.cached},
    }


def completion_response(
    model: str,
    parsed: schemas._Settings,
    answers: list[Answer],
    texts: list[str],
    tokens: Tokens,
    *,
    chat: bool,
) -> HttpResponse:
    prefix, kind = ("chatcmpl", "chat.completion") if chat else ("cmpl", "text_completion")
    head = {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
            "model": model}  # fmt: skip
    usage = _usage(tokens)
    if parsed.stream:
        include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
        return _stream(head, answers, texts, usage if include_usage else None, chat=chat)
    if chat:
        choices: list[dict[str, Any]] = [
            {"index": index, "message": {"role": "assistant", "content": text},
             "finish_reason": _finish_reason(answer), "logprobs": None}
            for index, (answer, text) in enumerate(zip(answers, texts, strict=True))
        ]  # fmt: skip
    else:
        choices = [
            {
                "text": text,
                "index": index,
                "finish_reason": _finish_reason(answer),
                "logprobs": None,
            }
            for index, (answer, text) in enumerate(zip(answers, texts, strict=True))
        ]
    return json_response(200, {**head, "choices": choices, "usage": usage})


def _stream(
    head: dict[str, Any],
    answers: list[Answer],
    texts: list[str],
    usage: dict[str, Any] | None,
    *,
    chat: bool,
) -> HttpResponse:
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    events = []
    for index, (answer, text) in enumerate(zip(answers, texts, strict=True)):
        if chat:
            content = {"index": index, "delta": {"role": "assistant", "content": text},
                       "finish_reason": None, "logprobs": None}  # fmt: skip
            finish = {
                "index": index,
                "delta": {},
                "finish_reason": _finish_reason(answer),
                "logprobs": None,
            }
        else:
            content = {"text": text, "index": index, "finish_reason": None, "logprobs": None}
            finish = {
                "text": "",
                "index": index,
                "finish_reason": _finish_reason(answer),
                "logprobs": None,
            }
        events.append({**head, "choices": [content]})
        events.append({**head, "choices": [finish]})
    if usage is not None:
        events.append({**head, "choices": [], "usage": usage})
    body = "".join(
        f"data: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"
        for event in events
    )
    response = HttpResponse(body + "data: [DONE]\n\n", content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # a proxy passes the events on as they come
    return response
