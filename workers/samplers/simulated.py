"""The simulated sampler: the problem's contract, without a model.

Each call takes SIMULATED_BATCH_MS whatever the batch size (the GPU is busy for the whole
call) and returns deterministic, prompt-specific completions, so a test or a benchmark can
check that every answer went back to the request that asked for it.

A /sample request gets `expected_completion(prompt)` whatever the queue's policy. A request
with its own settings (the OpenAI-compatible API) gets the same completion shaped by them, so
that every setting is observable without a model: its tokens are whitespace-separated words;
a temperature above 0 draws the first three words from the row's own random stream (seeded by
its `seed`, else fresh); max tokens keeps the first words (`length`); a stop string cuts the
text before it (`stop`). A chat is rendered with batching.generation.render_chat_plain.

It streams (`complete_streaming`): a streaming row's words arrive spread over the call.

A call's time is its cost profile's (SIMULATED_COST, batching.call_cost): under `contract`,
SIMULATED_BATCH_MS whatever its shape, each streaming row's words spread evenly over it; under
a fitted profile, the time its shape costs (rows, longest prompt, steps to its longest row's
end, a word a token), its words one a step after the prefill. A streaming row whose client
left (the sink says so) stops at that step, and such a call ends with its last live row.
The answers are shaped within the call's time.
"""

from __future__ import annotations

import hashlib
import random
import re
import time
from dataclasses import dataclass

from batching.call_cost import CostProfile, Shape
from batching.generation import Completion, FinishReason, Row, RowSettings, cut_at_stop
from workers.samplers.base import PromptRejected, Sampler, StreamSink

KNOWN_COMPLETIONS = {
    "E equals ": "MC squared",
    "For every action, there is ": "an equal and opposite reaction",
}

_WORDS = [
    "amber",
    "basalt",
    "cobalt",
    "delta",
    "ember",
    "fjord",
    "garnet",
    "harbor",
    "indigo",
    "juniper",
    "kestrel",
    "lumen",
    "meadow",
    "nimbus",
    "onyx",
    "prism",
    "quartz",
    "raven",
    "sierra",
    "tundra",
    "umber",
    "vertex",
    "willow",
    "xenon",
    "yarrow",
    "zephyr",
]


def expected_row_completion(
    prompt: str, settings: RowSettings, extra_words: int = 0
) -> tuple[str, FinishReason]:
    """What the simulated sampler answers a row with its own settings, and why it ended."""
    words = expected_completion(prompt, extra_words).split(" ")
    if not settings.greedy:
        # A stand-in for a model's draw, not a secret.
        seed = settings.seed if settings.seed is not None else random.random()  # noqa: S311
        stream = random.Random(seed)  # noqa: S311
        words[:3] = [stream.choice(_WORDS) for _ in range(3)]
    reason = FinishReason.STOP
    if len(words) > settings.max_tokens:
        words, reason = words[: settings.max_tokens], FinishReason.LENGTH
    text, stopped = cut_at_stop(" ".join(words), settings.stop)
    return text, FinishReason.STOP if stopped else reason


def expected_completion(prompt: str, extra_words: int = 0) -> str:
    """The completion the simulated sampler gives `prompt`: a known answer, else three words
    drawn from a hash of the prompt followed by its length, so distinct prompts get distinct
    answers; then `extra_words` more words drawn from another hash of it (SIMULATED_EXTRA_WORDS:
    longer completions, to stream)."""
    known = KNOWN_COMPLETIONS.get(prompt)
    if known is not None:
        text = known
    else:
        digest = hashlib.blake2b(prompt.encode("utf-8"), digest_size=6).digest()
        words = [_WORDS[digest[i] % len(_WORDS)] for i in range(3)]
        text = f"{' '.join(words)} {digest.hex()[:6]} ({len(prompt)} chars)"
    if extra_words:
        more = hashlib.blake2b(prompt.encode("utf-8"), digest_size=extra_words, person=b"more")
        text += "".join(f" {_WORDS[byte % len(_WORDS)]}" for byte in more.digest())
    return text


@dataclass
class _Call:
    """A `complete` in progress: its rows and sink, and the answers `sample` shaped for them
    within the call's time."""

    rows: list[Row]
    sink: StreamSink | None
    answers: list[Completion | PromptRejected] | None = None


class SimulatedSampler(Sampler):
    name = "simulated"

    def __init__(
        self, batch_ms: float = 100.0, extra_words: int = 0, cost: CostProfile | None = None
    ) -> None:
        self.batch_ms = batch_ms
        self.extra_words = extra_words
        self.cost = cost or CostProfile.contract(batch_ms)
        self.cost_profile = self.cost
        self._call: _Call | None = None  # while `complete` runs
        self.last_steps = 0  # the steps the last call ran (its cost's, not the contract's)

    def sample(self, prompts: list[str]) -> list[str | PromptRejected]:
        """The call: from its start to its end, the time its cost profile says. Under
        `complete`, it shapes the rows' answers (their settings, their tokens) within that
        time too, as a model's call does: a call of 100 API rows took 1 ms longer when they
        were shaped after it."""
        started = time.perf_counter()
        completions: list[str | PromptRejected] = [
            expected_completion(p, self.extra_words) for p in prompts
        ]
        call = self._call
        if call is not None and len(call.rows) == len(prompts):
            call.answers = self._completions(call.rows, completions)
        else:  # a call of bare prompts: the queue's settings
            call = _Call([Row(p, self.row_settings(), bare=True) for p in prompts], None)
            call.answers = self._completions(call.rows, completions)
        if self.cost.is_contract:
            self._wait_out_contract(started, call)
        else:
            self._wait_out_profile(started, call)
        return completions

    def complete(self, rows: list[Row]) -> list[Completion | PromptRejected]:
        return self._complete(rows, None)

    def complete_streaming(
        self, rows: list[Row], sink: StreamSink
    ) -> list[Completion | PromptRejected]:
        """The call's completions, each streaming row's words spread evenly over the call, as
        a model's tokens come: word k of n (with the space before it) sent k/n of the way
        through, the last as the call ends."""
        return self._complete(rows, sink)

    def _complete(
        self, rows: list[Row], sink: StreamSink | None
    ) -> list[Completion | PromptRejected]:
        """The call is `sample` (and a probe's hooks on it): what it rejects stays rejected."""
        self._call = call = _Call(rows, sink)
        try:
            texts = self.sample([row.prompt for row in rows])
        finally:
            self._call = None
        if len(texts) != len(rows):  # the worker's runner reports the mismatch
            return list(texts)  # type: ignore[arg-type]
        answers = call.answers or self._completions(rows, texts)  # a hook's own call
        return [text if isinstance(text, PromptRejected) else answer
                for text, answer in zip(texts, answers, strict=True)]  # fmt: skip

    def _wait_out_contract(self, started: float, call: _Call) -> None:
        """Sleep until the call has lasted `batch_ms`, sending the streaming rows' words as
        they come due."""
        call_s = self.batch_ms / 1000
        if call.sink is not None and call.answers is not None:
            for share, index, text, tokens in _pieces(call.rows, call.answers):
                wait_s = started + share * call_s - time.perf_counter()
                if wait_s > 0:
                    time.sleep(wait_s)
                call.sink(index, text, tokens)
        remaining = started + call_s - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)

    def _wait_out_profile(self, started: float, call: _Call) -> None:
        """Sleep for the call's cost: its prefill, then a step for each token of its longest
        live row; a streaming row's word k sent at its step k, none after its client left."""
        assert call.answers is not None
        steps = [self._steps(row, answer) for row, answer in zip(call.rows, call.answers,
                                                                strict=True)]  # fmt: skip
        shape = Shape(
            rows=len(call.rows),
            prompt_tokens=max(self.count_tokens(row.prompt) for row in call.rows),
            steps=max(steps),
            max_new_tokens=max(row.settings.max_tokens for row in call.rows),
        )
        prefill_s, step_s = self.cost.prefill_ms(shape) / 1000, self.cost.step_ms(shape) / 1000
        if call.sink is not None:
            by_step = sorted(_pieces(call.rows, call.answers), key=lambda piece: piece[3][1])
            for _, index, text, tokens in by_step:
                step = tokens[1]
                if step > steps[index]:  # its client left at an earlier step
                    continue
                wait_s = started + prefill_s + step * step_s - time.perf_counter()
                if wait_s > 0:
                    time.sleep(wait_s)
                if call.sink(index, text, tokens):  # its client left: it decodes no more
                    steps[index] = step
        self.last_steps = max(steps)
        remaining = started + prefill_s + self.last_steps * step_s - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)

    def _steps(self, row: Row, answer: Completion | PromptRejected) -> int:
        """The steps a row decodes: its completion's tokens, at most its max tokens (a bare
        row's text is the contract's, whatever its length)."""
        if isinstance(answer, PromptRejected):
            return 0
        return min(answer.completion_tokens, row.settings.max_tokens)

    def _completions(
        self, rows: list[Row], texts: list[str | PromptRejected]
    ) -> list[Completion | PromptRejected]:
        completions: list[Completion | PromptRejected] = []
        for row, text in zip(rows, texts, strict=True):
            if isinstance(text, PromptRejected):
                completions.append(text)
                continue
            if row.bare:  # a /sample row: the contract's answer, whatever the policy
                tokens = self.count_tokens(row.prompt), self.count_tokens(text)
                completions.append(Completion(text, FinishReason.STOP, *tokens))
                continue
            answer, reason = expected_row_completion(row.prompt, row.settings, self.extra_words)
            completions.append(
                Completion(answer, reason, self.count_tokens(row.prompt), self.count_tokens(answer))
            )
        return completions


def _pieces(
    rows: list[Row], answers: list[Completion | PromptRejected]
) -> list[tuple[float, int, str, tuple[int, int]]]:
    """The streaming rows' words as (share of the call, row, text, the row's tokens with it:
    prompt, completion so far), in the order they are due."""
    pieces: list[tuple[float, int, str, tuple[int, int]]] = []
    for index, (row, answer) in enumerate(zip(rows, answers, strict=True)):
        if row.stream and isinstance(answer, Completion):
            words = re.findall(r"\s*\S+", answer.text)
            pieces += [((k + 1) / len(words), index, w, (answer.prompt_tokens, k + 1))
                       for k, w in enumerate(words)]  # fmt: skip
    return sorted(pieces)
