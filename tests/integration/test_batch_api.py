"""OpenAI's Batch API end to end, with the `openai` client: upload a JSONL file, create a batch,
poll it, download its output and error files; against gunicorn, a simulated worker and Redis.
The lines ride in the backfill lane: whole batches of them while no request comes, and the
places interactive batches leave empty while requests do."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from batching.aggregator import BatchAggregator
from devstack.stack import Stack
from tests.support.batches import (
    CHAT,
    batch_stack,
    chat_lines,
    completed,
    create,
    ended,
    jsonl,
    keyed_client,
    records,
)
from tests.support.http import request
from tests.support.queue_views import batch_log_of
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

# Lines of a job cancelled as it runs: 10 s of calls of 100 every 50 ms.
CANCELLED_LINES = 20_000


@pytest.fixture(scope="module")
def stack(start_stack: Callable[..., Stack], tmp_path_factory: pytest.TempPathFactory) -> Stack:
    return batch_stack(start_stack, "batch", tmp_path_factory.mktemp("batch-files"))


@pytest.fixture(scope="module")
def model(stack: Stack) -> str:
    return stack.env["SAMPLING_QUEUE"]


@pytest.fixture(scope="module")
def client(stack: Stack) -> OpenAI:
    return keyed_client(stack)


def test_a_batch_runs_to_its_output_with_each_custom_id_once(client: OpenAI, model: str) -> None:
    lines = chat_lines(model, 250, "idle")
    done = ended(client, create(client, lines).id)
    assert done.status == "completed", done
    counts = done.request_counts
    assert counts is not None
    assert (counts.total, counts.completed, counts.failed) == (250, 250, 0)
    output = records(client, done.output_file_id)
    assert [r["custom_id"] for r in output] == [line["custom_id"] for line in lines]
    assert done.error_file_id is None
    # Each answer is what the same request gets interactively.
    for record, line in list(zip(output, lines, strict=True))[:5]:
        assert record["error"] is None
        assert record["response"]["status_code"] == 200
        interactive = client.chat.completions.create(**line["body"])
        body = record["response"]["body"]
        assert body["choices"][0]["message"]["content"] == interactive.choices[0].message.content
        assert interactive.usage is not None
        assert body["usage"]["completion_tokens"] == interactive.usage.completion_tokens


def test_a_line_its_endpoint_refuses_is_answered_as_the_endpoint_would(
    client: OpenAI, model: str
) -> None:
    lines = chat_lines(model, 20, "mixed")
    lines[3]["body"]["temperature"] = 7  # above the API's bound
    done = ended(client, create(client, lines).id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (19, 1)
    errors = records(client, done.error_file_id)
    assert [r["custom_id"] for r in errors] == ["mixed-3"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**lines[3]["body"])
    assert errors[0]["response"]["status_code"] == 400
    assert errors[0]["response"]["body"]["error"]["message"] == refused.value.body["message"]  # type: ignore[index]
    output = records(client, done.output_file_id)
    assert {r["custom_id"] for r in output} == {line["custom_id"] for line in lines} - {"mixed-3"}


def test_a_file_that_is_no_batch_fails_validation(client: OpenAI, model: str) -> None:
    lines = chat_lines(model, 3, "bad")
    lines[2]["custom_id"] = lines[0]["custom_id"]
    done = ended(client, create(client, lines).id)
    assert done.status == "failed"
    assert done.errors is not None
    assert done.errors.data
    assert "not unique" in (done.errors.data[0].message or "")


def test_interactive_batches_carry_backfill_in_their_empty_places(
    stack: Stack, client: OpenAI, model: str
) -> None:
    """While requests come, the job's lines ride in their batches' empty places."""
    aggregator = BatchAggregator(redis.Redis.from_url(stack.env["REDIS_URL"]), model)
    lines = chat_lines(model, 2000, "shared")
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    created = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT,
                                    completion_window="24h")  # fmt: skip

    def ask(index: int) -> str:
        answer = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"now {index}"}], max_tokens=8
        )
        return answer.choices[0].message.content or ""

    def shared() -> bool:
        records = [json.loads(raw) for raw in batch_log_of(aggregator).recent()]
        return any(r["size"] > 0 and r.get("backfill", 0) > 0 for r in records)

    with ThreadPoolExecutor(8) as pool:
        deadline = time.monotonic() + 20
        while not shared() and time.monotonic() < deadline:
            assert all(list(pool.map(ask, range(16))))
    assert shared()
    done = ended(client, created.id)
    assert done.status == "completed"
    assert completed(done) == 2000
    assert len({r["custom_id"] for r in records(client, done.output_file_id)}) == 2000


def test_a_cancelled_batch_ends_with_every_custom_id_once(client: OpenAI, model: str) -> None:
    lines = chat_lines(model, CANCELLED_LINES, "cancel")
    uploaded = client.files.create(file=("c.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    created = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT,
                                    completion_window="24h")  # fmt: skip
    wait_until(lambda: completed(client.batches.retrieve(created.id)) > 0, timeout_s=30)
    cancelling = client.batches.cancel(created.id)
    assert cancelling.status == "cancelling"
    done = ended(client, created.id)
    assert done.status == "cancelled"
    output = records(client, done.output_file_id)
    errors = records(client, done.error_file_id)
    assert errors
    assert all(r["error"]["code"] == "batch_cancelled" for r in errors)
    ids = [r["custom_id"] for r in output + errors]
    assert sorted(ids) == sorted(line["custom_id"] for line in lines)  # each once
    assert completed(done) == len(output) < CANCELLED_LINES


def test_a_key_sees_only_its_own_files_and_batches(
    stack: Stack, client: OpenAI, model: str
) -> None:
    content = io.BytesIO(jsonl(chat_lines(model, 1, "own")))
    uploaded = client.files.create(file=("own.jsonl", content), purpose="batch")
    other = keyed_client(stack, "other")
    with pytest.raises(openai.NotFoundError):
        other.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    assert other.batches.list().data == []
    anonymous = request(stack.base_url, "/v1/batches", method="GET")
    assert anonymous.status == 401
    assert json.loads(anonymous.body)["error"]["code"] == "missing_api_key"


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/files?limit=%C2%B2", None),  # "²" is a digit to str.isdigit
        ("GET", "/v1/batches?limit=" + "9" * 3000, None),  # gunicorn takes 4,094-byte lines
        ("GET", "/v1/batches?after=batch_%00", None),
        ("GET", "/v1/batches?after=" + "b" * 3000, None),
        ("GET", "/v1/files/file-%00", None),
        ("GET", "/v1/batches/" + "batch_" + "f" * 3000, None),
        ("POST", "/v1/batches", {"endpoint": [], "input_file_id": "file-00"}),
        ("POST", "/v1/batches", {"endpoint": {"a": 1}, "input_file_id": "file-00"}),
        ("POST", "/v1/batches", {"endpoint": CHAT, "input_file_id": {"x": []}}),
        ("POST", "/v1/batches", {"endpoint": CHAT, "input_file_id": "file-\u0000"}),
        ("POST", "/v1/batches", {"endpoint": CHAT, "metadata": {"k": "v\u0000"}}),
        ("POST", "/v1/batches", {"endpoint": CHAT, "metadata": {"k": "v" * 100_000}}),
        ("POST", "/v1/batches", {"endpoint": CHAT, "metadata": {str(i): "" for i in range(99)}}),
        ("POST", "/v1/batches", {"endpoint": CHAT, "metadata": {"k": "\ud800"}}),
        ("POST", "/v1/batches", {"endpoint": CHAT, "metadata": {"\udfff": "v"}}),
        ("POST", "/v1/batches", {"endpoint": CHAT, "input_file_id": ["file-00"]}),
        ("POST", "/v1/batches", "[" * 100_000 + "]" * 100_000),
        ("GET", "/v1/files?purpose=a%00b", None),
    ],
)  # fmt: skip
def test_hostile_parameters_get_a_4xx_that_says_why(
    stack: Stack, client: OpenAI, method: str, path: str, body: dict[str, Any] | str | None
) -> None:
    headers = {"Authorization": f"Bearer {client.api_key}", "Content-Type": "application/json"}
    payload = json.dumps(body) if isinstance(body, dict) else body
    reply = request(stack.base_url, path, payload, method=method, headers=headers)
    assert 400 <= reply.status < 500, reply
    assert json.loads(reply.body)["error"]["message"]


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("multipart/form-data", b"purpose=batch"),  # no boundary
        ("multipart/form-data; boundary=b",
         b'--b\r\nContent-Disposition: form-data; name="file"; filename="' + b"f" * 5000
         + b'.jsonl"\r\nContent-Type: application/octet-stream\r\n\r\n{}\n\r\n--b--\r\n'),
    ],
)  # fmt: skip
def test_an_upload_the_parser_refuses_gets_the_api_s_own_4xx(
    stack: Stack, client: OpenAI, content_type: str, body: bytes
) -> None:
    headers = {"Authorization": f"Bearer {client.api_key}", "Content-Type": content_type}
    reply = request(stack.base_url, "/v1/files", body, headers=headers)
    assert 400 <= reply.status < 500, reply
    assert json.loads(reply.body)["error"]["message"], reply


def test_a_job_whose_input_cannot_be_read_fails_and_is_counted(
    stack: Stack, client: OpenAI
) -> None:
    uploaded = client.files.create(file=("gone.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    files = Path(stack.env["SAMPLING_FILES_DIR"])
    (stored,) = [path for path in files.rglob(f"{uploaded.id}*") if path.is_file()]
    stored.unlink()  # lost from storage under its job
    before = _failures(stack)
    job = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    done = ended(client, job.id)
    assert done.status == "failed", done
    assert done.errors is not None
    assert done.errors.data is not None
    assert "cannot be validated" in str(done.errors.data[0].message)
    wait_until(lambda: _failures(stack) == before + 1, what="the failure on /metrics")


def _failures(stack: Stack) -> float:
    """`sampling_batch_job_failures_total{step="validated"}` on /metrics (0: none yet)."""
    text = request(stack.base_url, "/metrics", method="GET").body
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "sampling_batch_job_failures_total" and sample.labels == {
                "step": "validated"
            }:
                return float(sample.value)
    return 0.0


def test_a_big_upload_is_received_beside_the_files_it_becomes(stack: Stack, client: OpenAI) -> None:
    """Over Django's in-memory size, an upload is written in SAMPLING_UPLOAD_TEMP_DIR (by
    default on the files' volume, never a small /tmp), then stored by a rename."""
    lines = chat_lines(stack.env["SAMPLING_QUEUE"], 12_000, "big-upload")
    content = jsonl(lines)
    assert len(content) > 2_621_440  # FILE_UPLOAD_MAX_MEMORY_SIZE
    uploaded = client.files.create(file=("big.jsonl", io.BytesIO(content)), purpose="batch")
    assert uploaded.bytes == len(content)
    files = Path(stack.env["SAMPLING_FILES_DIR"])
    (stored,) = [path for path in files.rglob(f"{uploaded.id}*") if path.is_file()]
    assert stored.read_bytes() == content
    receiving = files / ".uploading"
    assert receiving.is_dir()  # where it arrived
    assert list(receiving.iterdir()) == []  # and whence it was moved
