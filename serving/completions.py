"""The shape of OpenAI's completions and chat completions as a whole answer (a stream's is
serving.streams')."""

from __future__ import annotations

import time
import uuid
from typing import Any

from django.http import HttpResponse

from batching.answers import Answer
from serving import schemas
from serving.responses import json_response
from serving.submission import Tokens


def _finish_reason(answer: Answer) -> str:
    # A worker of the version before the API answers [outcome, text]: count such an answer as
    # ended by the model, with no tokens (upgrade the workers before the web processes).
    return answer.finish_reason or "stop"


def usage_of(tokens: Tokens) -> dict[str, Any]:
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
    return json_response(200, completion_body(model, answers, texts, tokens, chat=chat))


def completion_body(
    model: str, answers: list[Answer], texts: list[str], tokens: Tokens, *, chat: bool
) -> dict[str, Any]:
    """A whole completion or chat completion, as OpenAI shapes it (also an offline job's
    line's answer: offline.lines)."""
    prefix, kind = ("chatcmpl", "chat.completion") if chat else ("cmpl", "text_completion")
    head = {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
            "model": model}  # fmt: skip
    usage = usage_of(tokens)
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
    return {**head, "choices": choices, "usage": usage}
