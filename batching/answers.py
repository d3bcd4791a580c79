"""One item's answer, and its one wire codec.

A worker answers each item of a batch; the batch's answers travel in Redis as Celery's
stored result (and one item's in the response cache) as a JSON list per item:

    [outcome, text]                                              a /sample item, or a failure
    [outcome, text, finish_reason, prompt_tokens, completion_tokens]   an API request's item

That list is the wire format old and new processes share during a rolling upgrade: `to_wire`
writes it exactly, `from_wire` reads any of its versions (an API answer of a worker from
before the API has two entries: ended by the model, no tokens). Everything else handles an
`Answer`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from batching.outcomes import ItemOutcome
from batching.problems import Problem

# An answer on the wire: the JSON list above.
WireAnswer = list[Any]


class Answer(NamedTuple):
    """A named tuple, not a dataclass: a worker makes one per item between two calls, on the
    GPU's path, and a tuple is made in a sixth of a frozen dataclass's time."""

    outcome: ItemOutcome
    text: str  # the completion for OK; a one-line reason otherwise
    # An API request's completion: why it ended, and its tokens. None: a /sample answer, a
    # failure, or an API answer of an older worker.
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def problem(self) -> Problem | None:
        """Why this item has no completion (batching.problems); None for a completion."""
        return Problem.of_item(self.outcome)

    def to_wire(self) -> WireAnswer:
        head: WireAnswer = [self.outcome.value, self.text]
        if self.finish_reason is None:
            return head
        return [*head, self.finish_reason, self.prompt_tokens, self.completion_tokens]

    @classmethod
    def from_wire(cls, raw: Sequence[Any]) -> Answer:
        try:
            outcome = ItemOutcome(raw[0])
        except ValueError:  # an outcome of a newer worker: no completion, whatever it is
            outcome = ItemOutcome.ERROR
        return cls(
            outcome,
            str(raw[1]),
            str(raw[2]) if len(raw) > 2 else None,
            int(raw[3]) if len(raw) > 3 else 0,
            int(raw[4]) if len(raw) > 4 else 0,
        )

    def to_json(self) -> str:
        """As the response cache keeps it."""
        return json.dumps(self.to_wire())

    @classmethod
    def from_json(cls, text: str | bytes) -> Answer:
        return cls.from_wire(json.loads(text))


def to_wire(answers: Iterable[Answer]) -> list[WireAnswer]:
    """A batch's answers, as a worker stores them."""
    return [answer.to_wire() for answer in answers]


def from_wire(raw: Iterable[Sequence[Any]]) -> list[Answer]:
    """A batch's answers, as a waiting request reads them."""
    return [Answer.from_wire(answer) for answer in raw]
