"""A streaming completion: Server-Sent Events in OpenAI's shape, written as the text is sampled.

The request's items join their batches marked streaming (serving.submission.enter), and the
response starts at once. Its events then follow its batches: each delta message of a batch
(batching.deltas) becomes a content chunk per choice it carries; a batch's answers give each
of its choices what the deltas left out of its text (nothing, mostly), then its finish chunk.
After every choice, a usage chunk when `stream_options.include_usage`, then `data: [DONE]`.

A failure after the response started (the deadline, the sampler) is an error event, `data:
{"error": {...}}`, which OpenAI's clients raise as an APIError. What the view counts when it
returns (the outcome, latency, in-flight slot, usage) is counted here when the stream closes
(`Stream.on_close`). A stream that ends otherwise than whole (cut by its client, failed) is
charged what it delivered: each prompt's tokens once, if any of its choices sent text, and
the completion tokens sent (a choice answered, its answer's; else as its last delta sent
counted them). A client that leaves first (a write fails, or its socket reads as closed
while the stream waits) closes it as `cancelled`, and its items not answered yet are marked
so: a worker drops them before its call, or stops their text during it.
"""

from __future__ import annotations

import json
import select
import socket
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from typing import Any, NamedTuple

from celery import states
from django.http import HttpRequest, StreamingHttpResponse

from accounts.access import Caller
from batching.answers import Answer
from batching.catalog import Price
from batching.deltas import Feed
from batching.items import Ticket
from batching.outcomes import RequestOutcome
from batching.problems import Failure, Problem
from batching.results import ResultListener, SharedListenerRedisBackend
from serving import metrics, schemas
from serving.broker import app as celery_app
from serving.completions import usage_of
from serving.deadline import Deadline
from serving.submission import (
    Answers,
    Entered,
    RequestPath,
    Tokens,
    cancel,
    charge,
    charge_tokens,
    failure_of,
    unavailable,
)

SSE = "text/event-stream"
# While no text comes, a stream looks this often whether its client has left.
LEFT_CHECK_S = 0.05


class Stream:
    """A streaming answer's end: its outcome once it closes (`cancelled` until it ends on its
    own), and what is done then."""

    def __init__(self) -> None:
        self.outcome = RequestOutcome.CANCELLED
        self._on_close: list[Callable[[RequestOutcome], None]] = []

    def on_close(self, callback: Callable[[RequestOutcome], None]) -> None:
        self._on_close.append(callback)

    def closed(self) -> None:
        for callback in self._on_close:
            callback(self.outcome)


def _listener() -> ResultListener:
    backend = celery_app.backend
    assert isinstance(backend, SharedListenerRedisBackend)  # CELERY_RESULT_BACKEND is ours
    return backend.listener


def _event(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


class _Chunks:
    """The events of one completion in OpenAI's shape: a chunk's head, and each kind of
    chunk."""

    content_type = SSE

    def __init__(self, model: str, chat: bool) -> None:
        prefix, kind = (
            ("chatcmpl", "chat.completion.chunk") if chat else ("cmpl", "text_completion")
        )
        self.head = {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind,
                     "created": int(time.time()), "model": model}  # fmt: skip
        self.chat = chat

    def content(self, choice: int, text: str, *, first: bool = False) -> bytes:
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            body = {"index": choice, "delta": delta, "finish_reason": None, "logprobs": None}
        else:
            body = {"text": text, "index": choice, "finish_reason": None, "logprobs": None}
        return _event({**self.head, "choices": [body]})

    def finish(self, choice: int, reason: str) -> bytes:
        body: dict[str, Any] = {"index": choice, "finish_reason": reason, "logprobs": None}
        if self.chat:
            body["delta"] = {}
        else:
            body["text"] = ""
        return _event({**self.head, "choices": [body]})

    def usage(self, usage: dict[str, Any]) -> bytes:
        return _event({**self.head, "choices": [], "usage": usage})

    def error(self, failure: Failure) -> bytes:
        problem = failure.problem
        error = {"message": failure.message, "type": problem.openai_type, "param": None,
                 "code": problem.openai_code}  # fmt: skip
        return _event({"error": error})

    def done(self) -> bytes:
        return b"data: [DONE]\n\n"


class _Text:
    """/sample's stream (`?stream=1`), with _Chunks' methods: the completion's text as it
    comes, nothing else; a failure after it began is a last line that says so."""

    content_type = "text/plain; charset=utf-8"
    chat = False

    def content(self, choice: int, text: str, *, first: bool = False) -> bytes:
        return text.encode()

    def finish(self, choice: int, reason: str) -> bytes:
        return b""

    def usage(self, usage: dict[str, Any]) -> bytes:
        return b""

    def error(self, failure: Failure) -> bytes:
        return f"\n[{failure.status}] {failure.message}\n".encode()

    def done(self) -> bytes:
        return b""


def _answer_of(meta: dict[str, Any], index: int) -> Answer | Failure:
    if meta.get("status") != states.SUCCESS:
        return Failure(Problem.SAMPLER_FAILED, "the sampler failed for this batch")
    return Answer.from_wire(meta["result"][index])


class Ends(NamedTuple):
    """What a stream does as it ends: `charge(answers)` counts its answers' usage to its
    caller; `cancel(tickets)` marks the items of a client that left
    (serving.submission.cancel); `left()` says whether the client has left (its socket
    closed) while nothing is written to it; `timed(first, seconds)` counts when a content
    chunk went: since the request's arrival (its `first`), or since its choice's last."""

    charge: Callable[[Answers], Tokens]
    charge_tokens: Callable[[Tokens, Answers], None]
    cancel: Callable[[list[Ticket]], None]
    left: Callable[[], bool]
    timed: Callable[[bool, float], None]

    @classmethod
    def of(
        cls, request: HttpRequest, model: RequestPath, caller: Caller, price: Price, n: int = 1
    ) -> Ends:
        """A request's ends on its model (`n` choices per prompt, charged at `price`)."""
        return cls(
            lambda answers: charge(model.stats, caller, answers, price, n),
            lambda tokens, answers: charge_tokens(model.stats, caller, tokens, price, answers),
            lambda tickets: cancel(model, tickets),
            client_left(request.META.get("gunicorn.socket")),
            lambda first, seconds: _count_token_time(model, first, seconds),
        )


def _count_token_time(model: RequestPath, first: bool, seconds: float) -> None:
    """A content chunk's time on /metrics and the model's statistics (the stats page)."""
    if first:
        metrics.record_first_token(seconds)
    else:
        metrics.record_inter_token(seconds)
    model.stats.record_token_time(first, seconds)


def client_left(connection: socket.socket | None) -> Callable[[], bool]:
    """Whether the client of `connection` (gunicorn's `gunicorn.socket`) has closed it: it
    reads as at its end, without blocking; the bytes of a next request are left where they
    are. Without a socket (another server), never."""

    def left() -> bool:
        if connection is None:
            return False
        try:
            readable, _, _ = select.select([connection], [], [], 0)
            return bool(readable) and connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:  # reset by the peer, closed already
            return True

    return left


def completion_stream(
    model: str,
    ends: Ends,
    parsed: schemas._Settings,
    entered: Entered,
    echoed: list[str] | None,
    deadline: Deadline,
    *,
    chat: bool,
) -> tuple[StreamingHttpResponse, Stream]:
    """The streaming response of a request whose items `entered` their batches, and its end.
    Its feed opens now, before the response is handed to the server: a delta published
    before the server first asks for an event is kept, not lost."""
    include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
    events = _Events(_Chunks(model, chat), ends, include_usage, entered, echoed, parsed.n,
                     deadline)  # fmt: skip
    return _response(events), events.stream


def text_stream(
    ends: Ends, entered: Entered, deadline: Deadline
) -> tuple[StreamingHttpResponse, Stream]:
    """/sample's streaming response (`?stream=1`): its one prompt's text as it comes, plain,
    in chunked transfer (`curl -N`)."""
    events = _Events(_Text(), ends, False, entered, None, 1, deadline)
    return _response(events), events.stream


def _response(events: _Events) -> StreamingHttpResponse:
    response = StreamingHttpResponse(events, content_type=events.chunks.content_type)
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # nginx passes each piece on as it comes
    for name, value in events.entered.answers.headers().items():
        response[name] = value
    return response


class _Events:
    """A stream's events, one iteration; `close` (the server's, once the response is done
    with, written or not) ends it once: its feed closed, its items cancelled if its client
    left, its end counted."""

    def __init__(
        self,
        chunks: _Chunks | _Text,
        ends: Ends,
        include_usage: bool,
        entered: Entered,
        echoed: list[str] | None,
        n: int,
        deadline: Deadline,
    ) -> None:
        self.chunks, self.ends, self.include_usage = chunks, ends, include_usage
        self.entered, self.echoed, self.n = entered, echoed, n
        self.deadline = deadline
        self.stream = Stream()
        tickets = entered.tickets
        self.listener = _listener()
        self.feed = self.listener.open_feed([t.batch_id for t in tickets if t.cached is None])
        self.sent = [""] * len(tickets)
        self.sent_tokens: list[tuple[int, int] | None] = [None] * len(tickets)
        self.charged = False
        self.gapped = [False] * len(tickets)
        self.answers: list[Answer | None] = [None] * len(tickets)
        self.first_at = 0.0  # when its first content chunk went (monotonic; 0: none yet)
        self.last_at = [0.0] * len(tickets)  # each choice's last content chunk
        self._events = self._written()
        self._ended = False

    def __iter__(self) -> Iterator[bytes]:
        return self._events

    def close(self) -> None:
        self._events.close()
        self._end()

    def _end(self) -> None:
        if self._ended:
            return
        self._ended = True
        self.listener.close_feed(self.feed)
        if not self.charged:  # and its tokens reservation settled to them
            self.ends.charge_tokens(self._delivered(), self.entered.answers)
        metrics.record_stream_end(time.monotonic() - self.deadline.arrival)
        if self.stream.outcome is RequestOutcome.CANCELLED:
            tickets = self.entered.tickets
            left = [t for t, answer in zip(tickets, self.answers, strict=True) if answer is None]
            self.ends.cancel(left)
        self.stream.closed()

    def _written(self) -> Generator[bytes, None, None]:
        chunks, tickets = self.chunks, self.entered.tickets
        try:
            for choice in range(len(tickets)):
                opening = self.echoed[choice // self.n] if self.echoed is not None else ""
                if chunks.chat or opening:
                    yield chunks.content(choice, opening, first=True)
            while True:
                yield from self._deltas()
                failure = yield from self._answered()
                if failure is not None:
                    self.stream.outcome = failure.outcome
                    yield chunks.error(failure)
                    return
                if all(answer is not None for answer in self.answers):
                    break
                remaining = self.deadline.expires - time.monotonic()
                if self.ends.left():
                    return
                if remaining <= 0:
                    message = f"no completion within the {self.deadline.deadline_ms} ms deadline"
                    failure = Failure(Problem.DEADLINE, message)
                    self.stream.outcome = failure.outcome
                    yield chunks.error(failure)
                    return
                self.feed.wait(min(remaining, LEFT_CHECK_S))
            done = Answers(answer for answer in self.answers if answer is not None)
            done.from_cache = self.entered.answers.from_cache
            done.held_from(self.entered.answers)
            self.charged = True  # first: an exit during the charge never charges it twice
            tokens = self.ends.charge(done)
            if self.include_usage:
                yield chunks.usage(usage_of(tokens))
            yield chunks.done()
            self.stream.outcome = RequestOutcome.OK
        finally:
            self._end()

    def _deltas(self) -> Iterator[bytes]:
        """A content chunk for each delta of a choice still running that follows what it
        sent (a gap, a delta lost on the way, ends its deltas: its answer brings the rest)."""
        for task_id, deltas in self.feed.take():
            for choice, ticket in enumerate(self.entered.tickets):
                delta = deltas.get(ticket.index) if ticket.batch_id == task_id else None
                if delta is None or self.answers[choice] is not None or self.gapped[choice]:
                    continue
                if delta.offset != len(self.sent[choice]):
                    self.gapped[choice] = True
                elif delta.text:
                    self.sent[choice] += delta.text
                    if delta.prompt_tokens is not None and delta.completion_tokens is not None:
                        self.sent_tokens[choice] = (delta.prompt_tokens, delta.completion_tokens)
                    self._timed(choice)
                    yield self.chunks.content(choice, delta.text)

    def _delivered(self) -> Tokens:
        """What a stream that did not end whole delivered: each prompt's tokens once, if one
        of its choices sent anything; each choice's completion tokens sent (its answer's,
        answered; else its last delta's count, none where its sampler does not count)."""
        prompt = completion = 0
        for first in range(0, len(self.answers), self.n):
            prompt_tokens = 0
            for choice in range(first, first + self.n):
                answer, counted = self.answers[choice], self.sent_tokens[choice]
                if answer is not None:
                    prompt_tokens = prompt_tokens or answer.prompt_tokens
                    completion += answer.completion_tokens
                elif counted is not None:
                    prompt_tokens = prompt_tokens or counted[0]
                    completion += counted[1]
            prompt += prompt_tokens
        return Tokens(prompt, completion, 0)

    def _timed(self, choice: int) -> None:
        """A content chunk of `choice` goes now: the time to the first, or since its last."""
        now = time.monotonic()
        if not self.first_at:
            self.first_at = now
            self.ends.timed(True, now - self.deadline.arrival)
        elif self.last_at[choice]:
            self.ends.timed(False, now - self.last_at[choice])
        self.last_at[choice] = now

    def _answered(self) -> Generator[bytes, None, Failure | None]:
        """The rest and the finish chunk of each choice whose answer came; what failed one."""
        for choice, ticket in enumerate(self.entered.tickets):
            if self.answers[choice] is not None:
                continue
            found = _ready(self.feed, ticket.batch_id, ticket.index, ticket.cached, self.deadline)
            if isinstance(found, Failure):
                return found
            if found is None:
                continue
            self.answers[choice] = found
            sent = self.sent[choice]
            if found.text.startswith(sent) and len(found.text) > len(sent):
                self._timed(choice)
                yield self.chunks.content(choice, found.text[len(sent) :])
            yield self.chunks.finish(choice, found.finish_reason or "stop")
        return None


def _ready(
    feed: Feed, batch_id: str, index: int, cached: bytes | None, deadline: Deadline
) -> Answer | Failure | None:
    """A choice's answer once its batch has answered (or the response cache did), or what
    failed it; None while it runs."""
    if cached is not None:
        answer = Answer.from_json(cached)
    else:
        try:
            meta = feed.answers(batch_id)
        except LookupError:
            return unavailable()
        if meta is None:
            return None
        found = _answer_of(meta, index)
        if isinstance(found, Failure):
            return found
        answer = found
    return failure_of(answer, deadline) or answer
