"""Bursts of /sample requests judged by what admission promises: each request gets its own
completion, or a refusal that says so (a 503 with Retry-After, a 504 past the deadline), and
the refused are sent again, as a client would, until each has its own."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from tests.support.http import Reply, sample
from workers.samplers.simulated import expected_completion

# A burst's refused requests are sent again, as a client would, at most this many times.
BURST_ROUNDS = 5


def burst(base_url: str, prompts: list[str]) -> list[Reply]:
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        return list(pool.map(lambda prompt: sample(base_url, prompt), prompts))


def assert_admitted_or_refused(prompt: str, reply: Reply) -> None:
    """A 503 (with Retry-After) answers a burst that this machine cannot carry within the
    deadline, and a 504 one that a busy machine let run past it; a wrong answer never."""
    if reply.status == 200:
        assert reply.body == expected_completion(prompt)
    elif reply.status == 503:
        assert int(reply.headers["retry-after"]) >= 1, reply
    else:
        assert reply.status == 504, reply


def burst_until_answered(base_url: str, prompts: list[str]) -> int:
    """Send `prompts` at once, then the refused ones again, until each has its own completion
    (at most BURST_ROUNDS bursts); returns the requests sent in all."""
    pending, sent = prompts, 0
    for _ in range(BURST_ROUNDS):
        replies = dict(zip(pending, burst(base_url, pending), strict=True))
        sent += len(pending)
        for prompt, reply in replies.items():
            assert_admitted_or_refused(prompt, reply)
        pending = [prompt for prompt, reply in replies.items() if reply.status != 200]
        if not pending:
            return sent
    raise AssertionError(f"{len(pending)} prompts without a completion in {BURST_ROUNDS} bursts")
