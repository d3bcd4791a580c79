"""The sampler interface: `batched_sample(prompts) -> completions`, 1 to 100 prompts a call.

A sampler implements one method, `sample`, continuing every prompt with the queue's
generation settings. That is enough to serve every endpoint: the OpenAI-compatible API's
rows then reach it through `complete`'s default, which renders a chat with a fixed template,
cuts each completion at the row's own stop strings and counts whitespace-separated words as
tokens. A sampler that can honour each row's settings in one call (max tokens, temperature,
top-p, stops, seed) overrides `complete` (the Hugging Face and simulated samplers do), and one
with a tokenizer and a chat template overrides `render_chat` and `count_tokens`.

The checks of the contract (batch size, result length) live here and in workers.runner, so
no sampler repeats them.
"""

from __future__ import annotations

import abc
import time

from batching.call_cost import CostProfile
from batching.generation import (
    Completion,
    FinishReason,
    Row,
    RowSettings,
    cut_at_stop,
    render_chat_plain,
)
from batching.policy import MAX_BATCH_SIZE, GenerationSettings
from batching.streaming import StreamSink

# The contract's bound, named for samplers (one home: batching.policy).
MAX_BATCH = MAX_BATCH_SIZE

__all__ = [
    "MAX_BATCH",
    "Completion",
    "FinishReason",
    "GenerationSettings",
    "PromptRejected",
    "Row",
    "RowFailed",
    "RowSettings",
    "Sampler",
    "StreamSink",
]


class PromptRejected(Exception):
    """Returned (not raised) in place of one completion the sampler cannot produce for that
    prompt alone, e.g. a prompt longer than the model's context. The rest of the batch stands."""


class RowFailed(PromptRejected):
    """Returned (not raised) in place of one completion the sampler failed to produce for a
    reason of its own, not the prompt's (NaNs in that row's logits, say): that request gets a
    502 as for a failed call, while the rest of the batch stands and the worker stays healthy
    (a whole failed call counts toward leaving as unhealthy; a row does not)."""


class Sampler(abc.ABC):
    #: a short name for logs and the worker's heartbeat
    name: str = "sampler"
    #: the settings the next call uses; a sampler without generation settings ignores them
    generation: GenerationSettings = GenerationSettings()
    #: what its calls cost by their shape (batching.call_cost); None: the same whatever
    #: their shape, as the contract says (the worker keeps one running mean)
    cost_profile: CostProfile | None = None

    def configure(self, generation: GenerationSettings) -> None:
        """Use `generation` from the next call on (the worker calls it between calls when the
        policy changes). Raises ValueError, keeping the current settings, if they cannot
        apply."""
        self.generation = generation

    def batched_sample(self, prompts: list[str]) -> list[str | PromptRejected]:
        _check_batch(len(prompts))
        return self.sample(prompts)

    def batched_complete(
        self, rows: list[Row], sink: StreamSink | None = None
    ) -> list[Completion | PromptRejected]:
        """One call for rows with settings of their own: what the worker calls. With a
        `sink`, the streaming rows' new text goes to it as it is sampled."""
        _check_batch(len(rows))
        if sink is not None and any(row.stream for row in rows):
            return self.complete_streaming(rows, sink)
        return self.complete(rows)

    def complete_streaming(
        self, rows: list[Row], sink: StreamSink
    ) -> list[Completion | PromptRejected]:
        """`complete`, calling `sink(row index, new text)` for each row with `stream` set as
        its text grows (batching.streaming.StreamedText says what is safe to send: the deltas
        of a row, joined, are a prefix of its final text, which the answer carries whole).
        This default streams nothing: a sampler that cannot stream has each choice sent as
        one chunk, once its call ends."""
        return self.complete(rows)

    def complete(self, rows: list[Row]) -> list[Completion | PromptRejected]:
        """One Completion (or PromptRejected) per row, in order, each honouring its row's
        settings. This default continues every prompt with the queue's settings (`sample`).
        A `bare` row (/sample's) gets that text; any other (an API request's) gets it cut at
        its row's stop strings (`stop` when one was found, else `length`: it cannot tell an
        end of sequence from a limit), with tokens counted by `count_tokens`."""
        texts = self.sample([row.prompt for row in rows])
        if len(texts) != len(rows):  # the worker's runner reports the mismatch
            return list(texts)  # type: ignore[arg-type]
        completions: list[Completion | PromptRejected] = []
        for row, text in zip(rows, texts, strict=True):
            if isinstance(text, PromptRejected):
                completions.append(text)
                continue
            if row.bare:  # a /sample row: the text as `sample` wrote it (tokens: its usage)
                prompt_tokens, text_tokens = self.count_tokens(row.prompt), self.count_tokens(text)
                completions.append(
                    Completion(str(text), FinishReason.LENGTH, prompt_tokens, text_tokens)
                )
                continue
            cut, stopped = cut_at_stop(str(text), row.settings.stop)
            reason = FinishReason.STOP if stopped else FinishReason.LENGTH
            completions.append(
                Completion(cut, reason, self.count_tokens(row.prompt), self.count_tokens(cut))
            )
        return completions

    def render_chat(self, messages: tuple[tuple[str, str], ...]) -> str:
        """The prompt a chat is continued from (the model's own template, where it has one).
        Raises ValueError for a chat the template refuses."""
        return render_chat_plain(messages)

    def count_tokens(self, text: str) -> int:
        """Tokens of `text` for usage: whitespace-separated words for a sampler without a
        tokenizer."""
        return len(text.split())

    def row_settings(self) -> RowSettings:
        """The queue's settings as a row's: those of an item that sets none."""
        return RowSettings.of(self.generation)

    @abc.abstractmethod
    def sample(self, prompts: list[str]) -> list[str | PromptRejected]:
        """One completion (or PromptRejected) per prompt, in order."""

    def warm_up(self) -> float:
        """Run one call so the first request does not pay for lazy initialisation; returns its
        duration in ms, the worker's first estimate of a sampling call."""
        started = time.perf_counter()
        self.batched_sample(["warm-up"])
        return (time.perf_counter() - started) * 1000


def _check_batch(size: int) -> None:
    if size < 1:
        raise ValueError("a sampler call needs at least one prompt")
    if size > MAX_BATCH:
        raise ValueError(f"a sampler call takes at most {MAX_BATCH} prompts, got {size}")
