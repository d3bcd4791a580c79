"""Per-row settings inside one `generate` call: how each row samples and where it ends.

One call serves up to 100 requests, each with its own temperature, top-p, seed, max tokens and
stop strings. Hugging Face's `generate` applies one setting to the whole batch, so the call
runs greedy (argmax) and these two hooks make it row by row:

- `RowSampling` holds each row's temperature, top-p and seed as tensors. A greedy row stays
  exactly greedy (the argmax); a sampled row draws by Gumbel-max with noise hashed from its
  seed, the step and the token (workers.samplers.draws). So a seeded row gets the same
  tokens whatever else shares its batch, on either path.
- `RowEnds` (a stopping criterion) ends each row at its own max tokens, at an end-of-sequence
  token, or once its text contains one of its stop strings, and remembers which and when:
  the sampler keeps only the row's tokens up to its end. With `RowStreams` it also sends each
  streaming row's new text as the call samples it.

Imported by the Hugging Face sampler only (it needs torch). Both hooks serve `generate` and the
static-cache decode loop (workers.samplers.static_decode) alike.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LogitsProcessor, StoppingCriteria

from batching.generation import FinishReason, RowSettings
from batching.streaming import INCOMPLETE_CHARACTER, StreamedText, StreamSink
from workers.samplers.draws import chosen_tokens, seed_key

# Tokens decoded beyond a stop string's length when looking for it: a token may decode to
# part of a character, or to nothing (a special token).
STOP_WINDOW_SLACK = 4


class RowSampling(LogitsProcessor):
    """Each row's settings as tensors on the call's device ([rows, 1] each, `greedy` [rows]),
    for the static decoder's steps (workers.samplers.static_decode) and, as a logits processor,
    for eager `generate`: both draw the same tokens (workers.samplers.draws)."""

    def __init__(self, settings: list[RowSettings], device: str, prompt_length: int = 0) -> None:
        self.prompt_length = prompt_length  # where `generate`'s new tokens start
        self.sampled = any(not row.greedy for row in settings)
        # A request without a seed gets a fresh stream.
        keys = [seed_key(row.seed if row.seed is not None else secrets.randbits(63))
                for row in settings]  # fmt: skip
        self.greedy = torch.tensor([row.greedy for row in settings], device=device)
        self.temperature = torch.tensor(
            [[row.temperature if not row.greedy else 1.0] for row in settings],
            dtype=torch.float32,
            device=device,
        )
        self.top_p = torch.tensor(
            [[row.top_p] for row in settings], dtype=torch.float32, device=device
        )
        self.keys = torch.tensor([[key] for key in keys], dtype=torch.long, device=device)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> Any:
        """`generate`'s hook: a sampled row's scores become -inf but at its drawn token, so
        `generate`'s argmax takes the draw; a greedy row's stay as they are."""
        if not self.sampled:
            return scores
        step = torch.tensor([input_ids.shape[1] - self.prompt_length], device=scores.device)
        tokens = chosen_tokens(
            scores.float(), self.greedy, self.temperature, self.top_p, self.keys, step
        )
        drawn = torch.full_like(scores, float("-inf")).scatter(-1, tokens[:, None], 0.0)
        return torch.where(self.greedy[:, None], scores, drawn)


class RowEnds(StoppingCriteria):
    def __init__(
        self,
        settings: list[RowSettings],
        prompt_length: int,
        tokenizer: Any,
        eos_ids: frozenset[int],
    ) -> None:
        self.settings = settings
        self.prompt_length = prompt_length
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        # Per row, once ended: (tokens kept, why).
        self.ended: list[tuple[int, FinishReason] | None] = [None] * len(settings)
        longest_stop = max((len(stop) for row in settings for stop in row.stop), default=0)
        self.stop_window = longest_stop + STOP_WINDOW_SLACK if longest_stop else 0
        self.streams: RowStreams | None = None  # the streaming rows' text, step by step
        self.steps = 0  # decode steps observed: the call's, once it ends

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> Any:
        self.observe(input_ids)
        return torch.tensor(
            [end is not None for end in self.ended], dtype=torch.bool, device=input_ids.device
        )

    def observe(self, input_ids: torch.Tensor) -> bool:
        """Notes the rows that end with the newest token of `input_ids` (the padded prompts and
        the new tokens so far); whether every row has ended. One copy to the host a step."""
        generated = input_ids.shape[1] - self.prompt_length
        # The last token of every row, and the newest tokens of the rows that look for stop
        # strings (a stop completed by this step's token spans at most its length in tokens,
        # a few more for tokens that decode to partial text).
        window = min(generated, self.stop_window)
        recent = input_ids[:, input_ids.shape[1] - window :].tolist() if window else None
        last = [tokens[-1] for tokens in recent] if recent else input_ids[:, -1].tolist()
        return self._note(generated, last, recent)

    def observe_steps(self, new_tokens: list[list[int]], first: int) -> bool:
        """`observe` for each step from the `first`-th new token (1-based) to the last of
        `new_tokens` (each row's new tokens so far, on the host), in order: the static
        decoder reads several steps at once. Whether every row has ended; it stops there."""
        for generated in range(first, len(new_tokens[0]) + 1):
            window = min(generated, self.stop_window)
            last = [tokens[generated - 1] for tokens in new_tokens]
            recent = [tokens[generated - window : generated] for tokens in new_tokens]
            if self._note(generated, last, recent if window else None):
                return True
        return False

    def _note(self, generated: int, last: list[int], recent: list[list[int]] | None) -> bool:
        for row, settings in enumerate(self.settings):
            if self.ended[row] is not None:
                continue
            if last[row] in self.eos_ids:
                self.ended[row] = (generated - 1, FinishReason.STOP)
            elif settings.stop and recent is not None and self._has_stop(recent[row], settings):
                self.ended[row] = (generated, FinishReason.STOP)
            elif generated >= settings.max_tokens:
                self.ended[row] = (generated, FinishReason.LENGTH)
        self.steps = generated
        if self.streams is not None:
            for row in self.streams.step(last, self.ended, generated):  # their clients left
                self.ended[row] = (generated, FinishReason.LENGTH)
        return all(end is not None for end in self.ended)

    def _has_stop(self, recent: list[int], settings: RowSettings) -> bool:
        text = self.tokenizer.decode(recent, skip_special_tokens=True)
        return any(stop in text for stop in settings.stop)

    def kept(self, row: int, new_tokens: list[int]) -> tuple[list[int], FinishReason]:
        """The row's own tokens of the call's new tokens (padding and the end-of-sequence token
        left out), and why it ended."""
        end = self.ended[row]
        if end is None:  # the call ended first: the row reached the call's max new tokens
            limit = self.settings[row].max_tokens
            return new_tokens[:limit], FinishReason.LENGTH
        return new_tokens[: end[0]], end[1]


@dataclass
class _RowStream:
    """One streaming row: its tokens so far, their text decoded incrementally, and what of it
    was sent."""

    index: int  # the row's index in the call, as `sink` is told it
    sent: StreamedText
    tokens: list[int] = field(default_factory=list)
    decoded: str = ""
    prefix: int = 0  # vLLM's prefix and read offsets into `tokens`
    read: int = 0
    done: bool = False


class RowStreams:
    """The streaming rows' text as the call samples it: each step, every such row's newest
    token is decoded and its text sent as far as it is safe (batching.streaming.StreamedText).

    Decoding is incremental, as vLLM's detokenizer does it: each step decodes the row's last
    few tokens twice (with and without the newest), and the difference is the new text, so a
    step costs the same however long the row is; a token that decodes to half a character
    waits for the next."""

    def __init__(
        self,
        positions: dict[int, int],
        settings: list[RowSettings],
        tokenizer: Any,
        eos_ids: frozenset[int],
        sink: StreamSink,
        prompt_tokens: list[int] | None = None,
    ) -> None:
        """`positions`: the call's row (in `settings`) -> the index `sink` is told;
        `prompt_tokens`: each row's prompt's tokens (told with its text)."""
        self.prompt_tokens = prompt_tokens or [0] * len(settings)
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.sink = sink
        self.rows = {
            row: _RowStream(index, StreamedText(settings[row].stop))
            for row, index in positions.items()
        }

    def step(
        self, last: list[int], ended: list[tuple[int, FinishReason] | None], generated: int
    ) -> list[int]:
        """Take this step's token of every streaming row still going (`ended`: as RowEnds
        noted it, this step included); `generated` tokens so far. Returns the rows whose
        client left (the sink said so): they decode no more."""
        left: list[int] = []
        for row, stream in self.rows.items():
            if stream.done:
                continue
            end = ended[row]
            if end is not None:
                stream.done = True
                if end[0] < generated:  # ended before this token (an end of sequence)
                    continue
            if last[row] in self.eos_ids:
                continue
            stream.tokens.append(last[row])
            delta = stream.sent.update(self._decode(stream))
            tokens = (self.prompt_tokens[row], len(stream.tokens))
            if delta and self.sink(stream.index, delta, tokens) and end is None:
                stream.done = True
                left.append(row)
        return left

    def _decode(self, stream: _RowStream) -> str:
        """The row's text so far, its newest token decoded in the context of the few before
        it (vLLM's prefix and read offsets)."""
        tokens = stream.tokens
        before = self.tokenizer.decode(
            tokens[stream.prefix : stream.read], skip_special_tokens=True
        )
        now = self.tokenizer.decode(tokens[stream.prefix :], skip_special_tokens=True)
        if len(now) > len(before) and not now.endswith(INCOMPLETE_CHARACTER):
            stream.decoded += now[len(before) :]
            stream.prefix, stream.read = stream.read, len(tokens)
        return stream.decoded
