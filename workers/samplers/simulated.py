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
"""

from __future__ import annotations

import hashlib
import random
import re
import time

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


class SimulatedSampler(Sampler):
    name = "simulated"

    def __init__(self, batch_ms: float = 100.0, extra_words: int = 0) -> None:
        self.batch_ms = batch_ms
        self.extra_words = extra_words
        # While a streaming call runs: its pieces (share of the call, row, text) and its sink.
        self._streaming: tuple[list[tuple[float, int, str]], StreamSink] | None = None

    def sample(self, prompts: list[str]) -> list[str | PromptRejected]:
        started = time.perf_counter()
        completions: list[str | PromptRejected] = [
            expected_completion(p, self.extra_words) for p in prompts
        ]
        self._wait_out_call(started)
        return completions

    def complete(self, rows: list[Row]) -> list[Completion | PromptRejected]:
        texts = self.sample([row.prompt for row in rows])  # the call (and a probe's hooks)
        return self._completions(rows, texts)

    def complete_streaming(
        self, rows: list[Row], sink: StreamSink
    ) -> list[Completion | PromptRejected]:
        """The call's completions, each streaming row's words spread evenly over the call, as
        a model's tokens come: word k of n (with the space before it) sent k/n of the way
        through, the last as the call ends. The call is still `sample` (and a probe's hooks
        on it), which sends them while it waits."""
        expected: list[str | PromptRejected] = [
            expected_completion(row.prompt, self.extra_words) for row in rows
        ]
        answers = self._completions(rows, expected)
        pieces: list[tuple[float, int, str]] = []  # (share of the call, row, text)
        for index, (row, answer) in enumerate(zip(rows, answers, strict=True)):
            if row.stream and isinstance(answer, Completion):
                words = re.findall(r"\s*\S+", answer.text)
                pieces += [((k + 1) / len(words), index, w) for k, w in enumerate(words)]
        self._streaming = (sorted(pieces), sink)
        try:
            texts = self.sample([row.prompt for row in rows])
        finally:
            self._streaming = None
        if len(texts) != len(rows):  # the worker's runner reports the mismatch
            return list(texts)  # type: ignore[arg-type]
        return [text if isinstance(text, PromptRejected) else answer
                for text, answer in zip(texts, answers, strict=True)]  # fmt: skip

    def _wait_out_call(self, started: float) -> None:
        """Sleep until the call has lasted `batch_ms`, sending the streaming rows' pieces as
        they come due (complete_streaming)."""
        call_s = self.batch_ms / 1000
        if self._streaming is not None:
            pieces, sink = self._streaming
            for share, index, text in pieces:
                wait_s = started + share * call_s - time.perf_counter()
                if wait_s > 0:
                    time.sleep(wait_s)
                sink(index, text)
        remaining = started + call_s - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)

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
