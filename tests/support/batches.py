"""Offline jobs as a client runs them, with the `openai` client: a stack of their own (a
database of its own: its feeder feeds every job of its database), a key, JSONL lines,
a job run to its end, its output and error files read back."""

from __future__ import annotations

import io
import json
import os
import uuid
from collections.abc import Callable, Iterator
from decimal import ROUND_FLOOR, Decimal
from pathlib import Path
from typing import Any, Literal

import openai
from openai import OpenAI
from openai.types import Batch

from batching.generation import render_chat_plain
from devstack.stack import ROOT, Stack, migrated_database
from tests.support.http import request
from tests.support.keys import PROBES, bearer, create_key
from tests.support.manage import manage
from tests.support.waiting import wait_until
from workers.samplers.simulated import expected_completion

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


# A priced model's prices (per 1,000 tokens) and batch price factor (priced_stack).
PROMPT_PRICE, COMPLETION_PRICE, FACTOR = Decimal("1.5"), Decimal("2.25"), Decimal("0.5")
PRICED = "priced for the batch tests"


def priced_stack(
    start_stack: Callable[..., Stack],
    label: str,
    model: str,
    files: Path,
    workers: int = 1,
    **env: str,
) -> Iterator[Stack]:
    """A stack of `model`, simulated and registered with prices and a batch price factor,
    once its web processes answer with them (the feeder polls the same catalog as often);
    the registration deleted after."""
    settings = {"SAMPLING_MODELS": f"{model}=simulated", "SAMPLING_QUEUE": model, **env}
    stack = batch_stack(start_stack, label, files, workers, **settings)
    manage(stack, "registermodel", model, "--prompt-price", str(PROMPT_PRICE),
           "--completion-price", str(COMPLETION_PRICE), "--batch-price-factor", str(FACTOR),
           "--description", PRICED)  # fmt: skip
    probe = client_of(stack, create_key(stack, "probe"))
    wait_until(lambda: all(_priced(probe, model) for _ in range(6)), what="the prices served")
    yield stack
    manage(stack, "registermodel", model, "--delete")


def _priced(probe: OpenAI, model: str) -> bool:
    """Whether the web process that answered serves `model` with its prices (False while it
    has not read the probe's key, where keys are required)."""
    try:
        return (probe.models.retrieve(model).model_extra or {}).get("description") == PRICED
    except openai.AuthenticationError:
        return False


def line_cost(body: dict[str, Any]) -> Decimal:
    """What one answered line of a priced_stack's model costs at its batch price (a token's
    price in billionths, rounded down as the service rounds it)."""

    def nanos(per_thousand: Decimal) -> Decimal:
        return (per_thousand * 1_000_000 * FACTOR).to_integral_value(rounding=ROUND_FLOOR)

    usage = body["usage"]
    return (usage["prompt_tokens"] * nanos(PROMPT_PRICE)
            + usage["completion_tokens"] * nanos(COMPLETION_PRICE)) / Decimal(10**9)  # fmt: skip


def usage_of(stack: Stack, key: str, model: str) -> dict[str, Any]:
    """A key's usage of `model` in /v1/usage, its spend as a Decimal; {} for none."""
    reply = request(stack.base_url, "/v1/usage", method="GET", headers=bearer(key))
    found = [m for m in json.loads(reply.body)["data"] if m["model"] == model]
    return {**found[0]["usage"], "spend": Decimal(found[0]["spend"])} if found else {}


def new_key(stack: Stack, *options: str) -> tuple[str, str, OpenAI]:
    """A new key's name, its secret and a client of it, once every web process knows it."""
    name = f"key-{uuid.uuid4().hex[:8]}"
    client = client_of(stack, create_key(stack, name, *options))
    wait_until(lambda: known_to_all(stack, client), timeout_s=10)
    return name, client.api_key, client


def client_of(stack: Stack, key: str) -> OpenAI:
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0)


def keyed_client(stack: Stack, name: str = "batcher") -> OpenAI:
    """A client with a new key, once every web process knows it."""
    client = client_of(stack, create_key(stack, f"{name}-{uuid.uuid4().hex[:6]}"))
    wait_until(lambda: known_to_all(stack, client), timeout_s=10)
    return client


def known_to_all(stack: Stack, client: OpenAI) -> bool:
    """The client's key known on its connection and on PROBES fresh ones (each may meet
    another web process): the Batch API needs a key where keys are optional."""
    headers = bearer(client.api_key)
    return known(client) and all(
        request(stack.base_url, "/v1/batches?limit=1", method="GET", headers=headers).status == 200
        for _ in range(PROBES)
    )


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


def own_answer(line: dict[str, Any]) -> str:
    """What the simulated sampler writes for a chat line of one user message."""
    (message,) = line["body"]["messages"]
    return expected_completion(render_chat_plain((("user", message["content"]),)))


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
