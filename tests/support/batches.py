"""Offline jobs as a client runs them, with the `openai` client: a stack of their own (a
database of its own: its feeder feeds every job of its database), a key, JSONL lines,
a job run to its end, its output and error files read back."""

from __future__ import annotations

import io
import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import openai
from openai import OpenAI
from openai.types import Batch

from inference_site.lib.stack import ROOT, Stack, migrated_database
from tests.support.keys import create_key
from tests.support.waiting import wait_until

Endpoint = Literal["/v1/chat/completions", "/v1/embeddings"]
CHAT: Endpoint = "/v1/chat/completions"
EMBEDDINGS: Endpoint = "/v1/embeddings"
ENDED = ("completed", "failed", "cancelled", "expired")


def batch_stack(
    start_stack: Callable[..., Stack], label: str, files: Path, workers: int = 1, **env: str
) -> Stack:
    settings = {
        "SAMPLER": "simulated",
        "SIMULATED_BATCH_MS": "50",
        "DATABASE_URL": migrated_database(ROOT, os.environ),
        "SAMPLING_FILES_DIR": str(files),
        **env,
    }
    return start_stack(label, env=settings, gpus=[None] * workers, web_processes=2)


def client_of(stack: Stack, key: str) -> OpenAI:
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0)


def keyed_client(stack: Stack, name: str = "batcher") -> OpenAI:
    """A client with a new key, once every web process knows it."""
    client = client_of(stack, create_key(stack, f"{name}-{uuid.uuid4().hex[:6]}"))
    wait_until(lambda: known(client), timeout_s=10)
    return client


def known(client: OpenAI) -> bool:
    try:
        client.batches.list(limit=1)
        return True
    except openai.AuthenticationError:
        return False


def chat_lines(model: str, count: int, tag: str, **settings: Any) -> list[dict[str, Any]]:
    return [
        {"custom_id": f"{tag}-{index}", "method": "POST", "url": CHAT,
         "body": {"model": model, "max_tokens": 16, "seed": index, **settings,
                  "messages": [{"role": "user", "content": f"{tag} question {index}"}]}}
        for index in range(count)
    ]  # fmt: skip


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def create(client: OpenAI, lines: list[dict[str, Any]] | bytes, endpoint: Endpoint = CHAT) -> Batch:
    """A job of `lines` (or of a file's raw content), once its file is uploaded."""
    content = lines if isinstance(lines, bytes) else jsonl(lines)
    uploaded = client.files.create(file=("input.jsonl", io.BytesIO(content)), purpose="batch")
    assert uploaded.bytes == len(content)
    created = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint,
                                    completion_window="24h")  # fmt: skip
    assert created.status == "validating"
    return created


def ended(client: OpenAI, batch_id: str, timeout_s: float = 60) -> Batch:
    def done() -> Batch | None:
        found = client.batches.retrieve(batch_id)
        return found if found.status in ENDED else None

    found = wait_until(done, timeout_s=timeout_s, what=f"batch {batch_id} ended")
    assert found is not None
    return found


def completed(batch: Batch) -> int:
    return batch.request_counts.completed if batch.request_counts else 0


def records(client: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]
