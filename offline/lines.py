"""One line of an offline job: read from its input file, checked, made an item of the backfill
lane (batching.backfill), and once answered, shaped as the endpoint answers interactively.

A line is `{"custom_id": ..., "method": "POST", "url": <the job's endpoint>, "body": {...}}`.
Its body is checked as the endpoint checks a request (serving.validation); a line the
endpoint would refuse is answered as it would be (a 400 in the error file) and never reaches
a GPU. A line is one completion, or one embedding: `n` above 1, several prompts or inputs,
`echo`, `stream` and base64 embeddings are refused.
"""

from __future__ import annotations

import codecs
import itertools
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from pydantic import BaseModel

from batching.answers import Answer
from batching.catalog import EMBEDDER, GENERATOR
from batching.embeddings import decode
from batching.generation import SampleRequest
from batching.outcomes import ItemOutcome
from batching.policy import Policy
from batching.problems import Failure
from serving import schemas
from serving.completions import completion_body
from serving.responses import Invalid
from serving.submission import Tokens
from serving.validation import check_settings, check_size, parse, sample_requests

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
ENDPOINTS: dict[str, type[BaseModel]] = {
    COMPLETIONS: schemas.CompletionRequest,
    CHAT: schemas.ChatCompletionRequest,
    EMBEDDINGS: schemas.EmbeddingRequest,
}


def kind_of(endpoint: str) -> str:
    """The kind of model (batching.catalog) that serves `endpoint`."""
    return EMBEDDER if endpoint == EMBEDDINGS else GENERATOR


# A request line nests no deeper than this (a chat's parts, a tool's JSON schema): deeper
# lines are refused before anything walks them recursively.
MAX_LINE_DEPTH = 64
# What a line over the size limit is read by, skipped to its end in constant memory.
SKIP_CHUNK_BYTES = 2**16
_END = object()


class BadLine(ValueError):
    """A line that is no request of the job (not JSON, no custom_id, another URL): the job
    fails validation with it."""


class UnreadableLine(ValueError):
    """A line no request can be read from (over the size limit, nested too deep, not UTF-8,
    a NUL character): that line's error, answered in the job's error file. `custom_id` is ""
    where none could be read."""

    def __init__(self, message: str, custom_id: str = "") -> None:
        super().__init__(message)
        self.custom_id = custom_id


@dataclass(frozen=True)
class Line:
    index: int  # from 0
    custom_id: str
    body: bytes  # the request's JSON


def raw_lines(handle: IO[bytes], limit: int) -> Iterator[tuple[bytes | None, int]]:
    """Each line of `handle` from where it stands, with its size in bytes (its newline
    included); a line over `limit` bytes as None (b"" if it is only whitespace), read through
    in chunks, never held whole. Lines end at a newline alone, as JSONL's do."""
    while raw := handle.readline(limit + 1):
        size = len(raw)
        if size <= limit or raw.endswith(b"\n"):
            yield raw, size
            continue
        text = bool(raw.strip())
        while raw and not raw.endswith(b"\n"):
            raw = handle.readline(SKIP_CHUNK_BYTES)
            size += len(raw)
            text = text or bool(raw.strip())
        yield (None if text else b""), size


def count_lines(chunks: Iterable[bytes]) -> int:
    """The lines of a file given in chunks that hold more than whitespace, counted as
    `raw_lines` splits them, in constant memory."""
    count, text = 0, False
    for chunk in chunks:
        *ended, rest = chunk.split(b"\n")
        for piece in ended:
            count += bool(text or piece.strip())
            text = False
        text = text or bool(rest.strip())
    return count + text


def read_line(index: int, raw: bytes, endpoint: str) -> Line:
    """The line `index` of a job's input (one JSON object): BadLine when it is no request of
    the job, UnreadableLine when it is that line's own error."""
    try:
        text = raw.removeprefix(codecs.BOM_UTF8).decode("utf-8")
    except UnicodeDecodeError:
        raise UnreadableLine(f"line {index + 1} is not UTF-8") from None
    try:
        found = json.loads(text)
    except RecursionError:
        raise UnreadableLine(_too_deep(index)) from None
    except ValueError as exc:
        raise BadLine(f"line {index + 1} is not JSON: {exc}") from None
    if not isinstance(found, dict):
        raise BadLine(f"line {index + 1} is not a JSON object")
    custom_id = found.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
        raise BadLine(f"line {index + 1}: custom_id must be a string of 1 to 512 characters")
    if not storable(custom_id):
        raise UnreadableLine(f"line {index + 1}: custom_id has a NUL or a lone surrogate")
    if found.get("method", "POST") != "POST":
        raise BadLine(f"line {index + 1}: method must be POST")
    if found.get("url") != endpoint:
        raise BadLine(f"line {index + 1}: url must be the batch's endpoint, {endpoint}")
    body = found.get("body")
    _check_tree(index, found, custom_id)
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        raise BadLine(f"line {index + 1}: body must be an object with a model")
    return Line(index, custom_id, json.dumps(body).encode())


def _check_tree(index: int, found: Any, custom_id: str) -> None:
    """UnreadableLine if the parsed line nests deeper than MAX_LINE_DEPTH or holds a NUL
    character (no database stores one in text); walked without recursion, with one iterator
    a level."""
    levels: list[Iterator[Any]] = [iter((found,))]
    while levels:
        value = next(levels[-1], _END)
        if value is _END:
            levels.pop()
        elif isinstance(value, str):
            if "\x00" in value:
                raise UnreadableLine(f"line {index + 1} has a NUL character (\\u0000)", custom_id)
        elif isinstance(value, dict | list):
            if len(levels) > MAX_LINE_DEPTH:
                raise UnreadableLine(_too_deep(index), custom_id)
            members = itertools.chain(value, value.values()) if isinstance(value, dict) else value
            levels.append(iter(members))


def storable(text: str) -> bool:
    """No NUL and no lone surrogate: text every database stores and UTF-8 writes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\x00" not in text


def _too_deep(index: int) -> str:
    return f"line {index + 1} nests deeper than {MAX_LINE_DEPTH} levels"


def model_of(line: Line) -> str:
    return str(json.loads(line.body)["model"])


def request_of(line: Line, endpoint: str, policy: Policy) -> SampleRequest:
    """The line's one sample request, checked as its endpoint checks one; Invalid if the
    endpoint would refuse it."""
    parsed = parse(ENDPOINTS[endpoint], line.body)
    if isinstance(parsed, schemas.EmbeddingRequest):
        return _embedding_request(parsed, policy)
    assert isinstance(parsed, schemas._Settings)
    if parsed.stream:
        raise Invalid("stream is not supported in a batch", "stream")
    if parsed.n != 1:
        raise Invalid("n must be 1 in a batch: send one line per choice", "n")
    check_settings(parsed, policy)
    if isinstance(parsed, schemas.ChatCompletionRequest):
        chat = tuple((message.role, message.text()) for message in parsed.messages)
        check_size("".join(content for _, content in chat), policy, "messages")
        requests = sample_requests(None, chat, parsed)
    else:
        assert isinstance(parsed, schemas.CompletionRequest)
        if parsed.echo:
            raise Invalid("echo is not supported in a batch", "echo")
        prompts = parsed.prompts()
        if len(prompts) != 1:
            raise Invalid("a batch line has one prompt: send one line per prompt", "prompt")
        check_size(prompts[0], policy, "prompt")
        requests = sample_requests(prompts, (), parsed)
    return requests[0]


def _embedding_request(parsed: schemas.EmbeddingRequest, policy: Policy) -> SampleRequest:
    texts = parsed.texts()
    if len(texts) != 1:
        raise Invalid("a batch line embeds one input: send one line per text", "input")
    if parsed.encoding_format != "float":
        raise Invalid("encoding_format must be float in a batch", "encoding_format")
    check_size(texts[0], policy, "input")
    return SampleRequest(prompt=texts[0], dimensions=parsed.dimensions)


def refused(invalid: Invalid) -> tuple[int, dict[str, Any]]:
    """A refused line's status and body, as the endpoint words a refusal."""
    error_type = "not_found_error" if invalid.status == 404 else "invalid_request_error"
    error = {"message": invalid.message, "type": error_type, "param": invalid.param,
             "code": invalid.code}  # fmt: skip
    return invalid.status, {"error": error}


def failed(failure: Failure) -> tuple[int, dict[str, Any]]:
    """A line's status and body for a request refused as `failure` (its key revoked, or over
    its budget), as the interactive API words it."""
    problem = failure.problem
    error = {"message": failure.message, "type": problem.openai_type, "param": None,
             "code": problem.openai_code}  # fmt: skip
    return problem.status, {"error": error}


def answered(endpoint: str, model: str, answer: Answer) -> tuple[int, dict[str, Any]]:
    """An answered line's status and body, as its endpoint answers interactively."""
    problem = answer.problem
    if (answer.outcome == ItemOutcome.OK or problem is None) and endpoint == EMBEDDINGS:
        return 200, embedding_body(model, answer)
    if answer.outcome == ItemOutcome.OK or problem is None:
        tokens = Tokens(answer.prompt_tokens, answer.completion_tokens, 0)
        return 200, completion_body(model, [answer], [answer.text], tokens, chat=endpoint == CHAT)
    error = {"message": answer.text, "type": problem.openai_type, "param": None,
             "code": problem.openai_code}  # fmt: skip
    return problem.status, {"error": error}


def embedding_body(model: str, answer: Answer) -> dict[str, Any]:
    """An embedding line's body, as /v1/embeddings answers one text in floats."""
    data = [{"object": "embedding", "index": 0, "embedding": decode(answer.text)}]
    usage = {"prompt_tokens": answer.prompt_tokens, "total_tokens": answer.prompt_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}
