"""A row's text as it is sampled, streamed only where no later token can change it.

A sampler that streams (workers.samplers.base.Sampler.complete_streaming) decodes each row's
tokens so far, step after step, and hands the text to its row's `StreamedText`, which says
what is new and safe to send:

- not a trailing U+FFFD: the start of a character whose other bytes are in a later token;
- not what may still be the start of a stop string: the answer is cut before a stop string,
  so the end of the text that is a prefix of one of the row's stops waits for the next token
  (which completes the stop, and it is never sent, or breaks it, and it is sent);
- nothing after a stop string;
- nothing that does not extend what was sent already (a tokenizer whose decoding of more
  tokens rewrites earlier text): the rest then arrives with the final answer.

So the deltas, joined, are always a prefix of the row's final text, and the final answer
carries the whole text: what streaming sent is never taken back, and nothing is lost when a
delta is.
"""

from __future__ import annotations

from typing import Protocol

from batching.generation import cut_at_stop


class StreamSink(Protocol):
    """Where a streaming row's new text goes: its index in the call, the text to append, and
    where the sampler counts them, its tokens so far (prompt, completion): what a stream its
    client cuts is charged (serving.streams). It returns True once the row's client has
    left: the sampler then stops decoding that row."""

    def __call__(
        self, row: int, text: str, tokens: tuple[int, int] | None = None
    ) -> bool | None: ...


INCOMPLETE_CHARACTER = "\ufffd"


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of `text` may still begin a stop string: the longest
    suffix that is a proper prefix of one of `stops`."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class StreamedText:
    """What of one row's text has been streamed, and what may be next."""

    def __init__(self, stops: tuple[str, ...] = ()) -> None:
        self.stops = stops
        self.sent = ""
        self.stopped = False

    def update(self, text: str) -> str:
        """The row's text so far (all of it, decoded from its tokens): what to send now."""
        if self.stopped:
            return ""
        safe, self.stopped = cut_at_stop(text, self.stops)
        if not self.stopped:
            safe = safe[: len(safe) - held_back(safe, self.stops)]
        safe = safe.rstrip(INCOMPLETE_CHARACTER)
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent) :], safe
        return delta
