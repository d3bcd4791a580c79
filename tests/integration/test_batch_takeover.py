"""A long offline job through the feeder's faults, over two workers: a 20,000-line job (several
feed passes) with its feeder killed (SIGKILL), then its feeder stopped (SIGSTOP) past its lock's
TTL while another takes over, then resumed. Each custom_id is in the output once, each with its
own line's answer (the simulated sampler's, as the interactive API gives it), and the key's
spend is exactly the job's lines' at the batch price."""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import pytest
import redis

from batching.keys import QueueKeys
from devstack.stack import Stack
from tests.support import unique_queue
from tests.support.batches import (
    chat_lines,
    completed,
    create,
    ended,
    line_cost,
    new_key,
    own_answer,
    priced_stack,
    records,
    usage_of,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

WORKERS = 2
LINES = 20_000
LOCK_TTL_S = 3


@pytest.fixture(scope="module")
def model() -> str:
    return unique_queue("batch-takeover")


@pytest.fixture(scope="module")
def stack(
    start_stack: Callable[..., Stack], model: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    yield from priced_stack(
        start_stack, "batch-takeover", model, tmp_path_factory.mktemp("files"),
        workers=WORKERS, SAMPLING_FEEDER_LOCK_TTL_S=str(LOCK_TTL_S),
    )  # fmt: skip


def test_a_long_job_through_a_killed_and_a_stalled_feeder(stack: Stack, model: str) -> None:
    _, secret, client = new_key(stack)
    lines = chat_lines(model, LINES, "takeover")
    job = create(client, lines)

    def past(fraction: float) -> bool:
        return completed(client.batches.retrieve(job.id)) >= fraction * LINES

    wait_until(functools.partial(past, 0.25), 120, "a quarter of the job")
    assert stack.feeder is not None
    os.kill(stack.feeder.pid, signal.SIGKILL)
    stack.feeder.wait(timeout=10)
    stack.start_feeder()
    wait_until(functools.partial(past, 0.5), 120, "half the job")
    stalled = stack.feeder
    lock = QueueKeys(model).feeder_lock
    direct = redis.Redis.from_url(stack.environment()["REDIS_URL"])
    held_by_stalled = direct.get(lock)
    os.kill(stalled.pid, signal.SIGSTOP)  # most likely in the middle of a run
    try:
        stack.start_feeder()  # takes over once the stalled one's lock has expired
        wait_until(lambda: direct.get(lock) not in (None, held_by_stalled), LOCK_TTL_S + 30,
                   "the other feeder holding the lock")  # fmt: skip
        os.kill(stalled.pid, signal.SIGCONT)  # resumed where it stopped, its lock lost
        done = ended(client, job.id, 180)
    finally:
        os.kill(stalled.pid, signal.SIGCONT)
        stack.stop_process(stalled)
    assert done.status == "completed", done
    output = records(client, done.output_file_id)
    by_id = {record["custom_id"]: record["response"]["body"] for record in output}
    assert len(by_id) == len(output) == LINES  # each custom_id once

    def answer(line: dict[str, Any]) -> str:
        return str(by_id[line["custom_id"]]["choices"][0]["message"]["content"])

    wrong = [line["custom_id"] for line in lines if answer(line) != own_answer(line)]
    assert not wrong, f"{len(wrong)} lines answered otherwise, the first {wrong[:5]}"
    spent = sum((line_cost(body) for body in by_id.values()), Decimal(0))
    tokens = sum(body["usage"]["completion_tokens"] for body in by_id.values())
    expected = {"completion_tokens": tokens, "spend": spent}

    def charged() -> dict[str, Any]:
        usage = usage_of(stack, secret, model)
        return {name: usage.get(name) for name in expected}

    try:
        wait_until(lambda: charged() == expected, timeout_s=15, what="the job's usage in /v1/usage")
    except AssertionError:
        assert charged() == expected  # says by how much
