"""Offline jobs as big inputs and hostile tenants bring them, over two workers. A 20,000-line
job takes several feed passes (one pushes at most AHEAD_CALLS calls' worth per live worker),
and each output record carries its own line's answer, the one the same request gets
interactively. Lines no request can be read from (nested 100,000 deep, 50 MB long, a NUL
character) are their own lines' errors: the job runs on, and another tenant's job with it."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from devstack.stack import Stack
from offline.feeder import AHEAD_CALLS
from tests.support.batches import (
    CHAT,
    batch_stack,
    chat_lines,
    completed,
    create,
    ended,
    jsonl,
    keyed_client,
    own_answer,
    records,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

LINES = 20_000
WORKERS = 2
MAX_BATCH = 100  # the environment policy's
# Lines looked at again by the interactive API: spread over the job, its last line included.
ASKED_AGAIN = 20
# Another tenant's job, created after one with such lines, is done within this.
OTHERS_DONE_WITHIN_S = 30
# The feeder's peak memory while it reads a file of one line this long.
ONE_LINE_BYTES = 150 * 10**6
FEEDER_PEAK_BYTES = 150 * 2**20


@pytest.fixture(scope="module")
def stack(start_stack: Callable[..., Stack], tmp_path_factory: pytest.TempPathFactory) -> Stack:
    return batch_stack(
        start_stack, "hostile-jobs", tmp_path_factory.mktemp("files"), workers=WORKERS,
        SAMPLING_MAX_BATCH_SIZE=str(MAX_BATCH),
    )  # fmt: skip


@pytest.fixture(scope="module")
def model(stack: Stack) -> str:
    return stack.env["SAMPLING_QUEUE"]


def test_every_line_of_a_long_job_gets_its_own_answer(stack: Stack, model: str) -> None:
    assert LINES >= 4 * AHEAD_CALLS * MAX_BATCH * WORKERS  # several passes
    client = keyed_client(stack)
    lines = chat_lines(model, LINES, "long")
    done = ended(client, create(client, lines).id, timeout_s=300)
    assert done.status == "completed", done
    assert done.error_file_id is None
    output = records(client, done.output_file_id)
    by_id = {record["custom_id"]: record for record in output}
    assert len(by_id) == len(output) == LINES  # each custom_id once

    def answer(index: int) -> str:
        body = by_id[lines[index]["custom_id"]]["response"]["body"]
        return str(body["choices"][0]["message"]["content"])

    wrong = [index for index in range(LINES) if answer(index) != own_answer(lines[index])]
    assert not wrong, f"{len(wrong)} lines answered otherwise, the first {wrong[:5]}"
    for index in [*range(0, LINES, LINES // ASKED_AGAIN), LINES - 1]:
        interactive = client.chat.completions.create(**lines[index]["body"])
        assert interactive.choices[0].message.content == answer(index), index


def hostile_line(custom_id: str, model: str, content: bytes) -> bytes:
    """A chat line whose message content is `content`, raw JSON."""
    head = {"custom_id": custom_id, "method": "POST", "url": CHAT}
    return (
        json.dumps(head)[:-1].encode()
        + b', "body": {"model": ' + json.dumps(model).encode()
        + b', "messages": [{"role": "user", "content": ' + content + b"}]}}\n"
    )  # fmt: skip


def test_unreadable_lines_are_their_own_errors_and_stop_no_job(stack: Stack, model: str) -> None:
    tenant_a, tenant_b = keyed_client(stack, "tenant-a"), keyed_client(stack, "tenant-b")
    good = chat_lines(model, 3, "fine")
    hostile = (
        hostile_line("deep", model, b"[" * 100_000 + b"]" * 100_000)
        + hostile_line("long", model, json.dumps("x" * 50 * 10**6).encode())
        + hostile_line("nul", model, b'"a\\u0000b"')
    )
    job_a = create(tenant_a, jsonl(good[:1]) + hostile + jsonl(good[1:])).id
    others = chat_lines(model, 100, "other")
    done_b = ended(tenant_b, create(tenant_b, others).id, timeout_s=OTHERS_DONE_WITHIN_S)
    assert done_b.status == "completed", done_b
    assert len(records(tenant_b, done_b.output_file_id)) == len(others)
    done_a = ended(tenant_a, job_a)
    assert done_a.status == "completed", done_a
    output = records(tenant_a, done_a.output_file_id)
    assert [r["custom_id"] for r in output] == [line["custom_id"] for line in good]
    assert all(r["response"]["body"]["choices"][0]["message"]["content"] == own_answer(line)
               for r, line in zip(output, good, strict=True))  # fmt: skip
    errors = records(tenant_a, done_a.error_file_id)
    # The deep and the long line name no custom_id that could be read; the NUL line does.
    assert [r["custom_id"] for r in errors] == [None, None, "nul"]
    reasons = [r["response"]["body"]["error"]["message"] for r in errors]
    assert [r["response"]["status_code"] for r in errors] == [400] * 3
    assert re.search(r"line 2 nests deeper", reasons[0]), reasons
    assert re.search(r"line 3 is over the \d+-byte limit", reasons[1]), reasons
    assert re.search(r"line 4 has a NUL character", reasons[2]), reasons
    counts = done_a.request_counts
    assert counts is not None
    assert (counts.total, counts.completed, counts.failed) == (6, 3, 3)


def test_a_file_of_one_long_line_is_read_in_bounded_memory(stack: Stack, model: str) -> None:
    client = keyed_client(stack, "one-line")
    content = hostile_line("huge", model, json.dumps("y" * ONE_LINE_BYTES).encode())
    done = ended(client, create(client, content).id)
    assert done.status == "failed", done  # no readable line, so no model: the job fails
    assert stack.feeder is not None
    status = Path(f"/proc/{stack.feeder.pid}/status").read_text()
    peak = re.search(r"VmHWM:\s+(\d+) kB", status)
    assert peak is not None
    assert int(peak.group(1)) * 1024 < FEEDER_PEAK_BYTES, status


def test_one_tenants_long_job_holds_no_other_tenants_job_back(stack: Stack, model: str) -> None:
    """The feeder deals the lanes' room to the keys in turn: a job created while another key's
    long one runs is fed at once, behind at most the lanes' room, not once the long one is all
    fed (with all but that room done)."""
    big, small = keyed_client(stack, "big"), keyed_client(stack, "small")
    long_job = create(big, chat_lines(model, LINES, "big"))
    wait_until(lambda: completed(big.batches.retrieve(long_job.id)) > 0, 60, "the long job")
    done = ended(small, create(small, chat_lines(model, 100, "small")).id, timeout_s=120)
    assert done.status == "completed", done
    room = AHEAD_CALLS * MAX_BATCH * WORKERS
    assert completed(big.batches.retrieve(long_job.id)) < LINES - room
    assert ended(big, long_job.id, timeout_s=300).status == "completed"
