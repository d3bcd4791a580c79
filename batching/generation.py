"""What one item of a batch asks of the model, and what it gets back.

A request to /sample carries only its prompt: the queue's policy decides how it is continued.
A request to the OpenAI-compatible API carries its own settings (`SampleRequest`): a prompt
or a chat to render with the model's template, and any of max tokens, temperature, top-p,
stop strings and a seed. The item in Redis carries them as JSON (batching.aggregator), the
worker resolves them against the queue's generation settings (`RowSettings`: the policy's
settings are the defaults), and the sampler honours them row by row in one call. Each such
item's answer carries a `Completion`: the text, why it ended and the tokens it counted.

Django- and model-free: the web process validates with these bounds, the worker decodes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from batching.policy import GenerationSettings

# OpenAI's bounds of the per-request settings (the policy's own bounds are wider: an operator
# may set a queue's temperature above 2; a request may not).
MAX_TEMPERATURE = 2.0
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 128
# The chat roles a template renders; a `tool` turn needs tool calling, which is not served.
CHAT_ROLES = ("system", "developer", "user", "assistant")
# A temperature below this is greedy (dividing float32 logits by less overflows them).
MIN_SAMPLING_TEMPERATURE = 1e-5
# A seed is any signed 64-bit integer, as OpenAI's is.
SEED_RANGE = (-(2**63), 2**63 - 1)


class FinishReason(StrEnum):
    STOP = "stop"  # the model ended it (end of sequence), or a stop string did
    LENGTH = "length"  # it reached its max tokens


@dataclass(frozen=True)
class SampleRequest:
    """One item's prompt (`prompt`, or `messages` as (role, content) pairs for the worker to
    render) and the settings it sets; None leaves a setting to the queue's policy."""

    prompt: str = ""
    messages: tuple[tuple[str, str], ...] = ()
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] | None = None
    seed: int | None = None
    dimensions: int | None = None  # an embedding's: the first this many, normalized

    def to_json(self) -> str:
        data: dict[str, Any] = {}
        if self.messages:
            data["messages"] = [list(message) for message in self.messages]
        else:
            data["prompt"] = self.prompt
        for name in ("max_tokens", "temperature", "top_p", "seed", "dimensions"):
            value = getattr(self, name)
            if value is not None:
                data[name] = value
        if self.stop is not None:
            data["stop"] = list(self.stop)
        return json.dumps(data, ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> SampleRequest:
        data = json.loads(raw)
        stop = data.get("stop")
        return cls(
            prompt=data.get("prompt", ""),
            messages=tuple((role, content) for role, content in data.get("messages", ())),
            max_tokens=data.get("max_tokens"),
            temperature=data.get("temperature"),
            top_p=data.get("top_p"),
            stop=None if stop is None else tuple(stop),
            seed=data.get("seed"),
            dimensions=data.get("dimensions"),
        )

    def settings(self, defaults: GenerationSettings) -> RowSettings:
        """This request's settings, the queue's `defaults` where it sets none. A max tokens
        above the queue's is cut to it (the web process refuses those already)."""
        return RowSettings(
            max_tokens=min(self.max_tokens or defaults.max_new_tokens, defaults.max_new_tokens),
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            stop=self.stop if self.stop is not None else stops_of(defaults),
            seed=self.seed,
            dimensions=self.dimensions,
        )


def stops_of(generation: GenerationSettings) -> tuple[str, ...]:
    return (generation.stop,) if generation.stop else ()


@dataclass(frozen=True)
class RowSettings:
    """One row's generation settings, resolved: what a sampler honours for that row alone."""

    max_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None  # None: a fresh random stream
    dimensions: int | None = None  # an embedder's: None for the model's own

    @classmethod
    def of(cls, generation: GenerationSettings) -> RowSettings:
        """The queue's settings, for an item that sets none (a /sample request)."""
        return cls(
            max_tokens=generation.max_new_tokens,
            temperature=generation.temperature,
            top_p=generation.top_p,
            stop=stops_of(generation),
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE


@dataclass(frozen=True)
class Row:
    """One row of a sampler call: the prompt as the model reads it (a chat already rendered)
    and its settings."""

    prompt: str
    settings: RowSettings
    templated: bool = False  # a chat rendered by the sampler's template (its special tokens in)
    bare: bool = False  # a /sample prompt: the queue's settings, and only its text is answered
    stream: bool = False  # its request streams: its new text is wanted step by step


@dataclass(frozen=True)
class Completion:
    """One row's answer: the text (cut before a stop string), why it ended, and its usage."""

    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """`text` before the first occurrence of any of `stops`, and whether one occurred."""
    cut = len(text)
    for stop in stops:
        position = text.find(stop)
        if 0 <= position < cut:
            cut = position
    return text[:cut], cut < len(text)


def render_chat_plain(messages: tuple[tuple[str, str], ...]) -> str:
    """The fixed chat template of a sampler without its own (the simulated sampler's): each
    turn as `<|role|>` on its own line followed by its content on the next, then
    `<|assistant|>` and a newline for the model to continue."""
    turns = "".join(f"<|{role}|>\n{content}\n" for role, content in messages)
    return turns + "<|assistant|>\n"
