"""What an offline job is charged, and embeddings as a job: a stack of a generator with
registered prices (and a batch price factor) and a simulated embedder, the `openai` client.
A job's tokens are its key's usage, and its spend is exactly those tokens at the model's
prices times the factor; an embeddings job's vectors are what /v1/embeddings answers."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from decimal import ROUND_FLOOR, Decimal
from pathlib import Path

import pytest
from openai import OpenAI

from devstack.stack import ROOT, Stack, migrated_database
from tests.support import unique_queue
from tests.support.batches import EMBEDDINGS, chat_lines, create, ended, keyed_client, records
from tests.support.http import request
from tests.support.keys import bearer
from tests.support.manage import manage
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

PROMPT_PRICE, COMPLETION_PRICE, FACTOR = Decimal("1.5"), Decimal("2.25"), Decimal("0.4")
PRICED = "priced for the batch test"


@pytest.fixture(scope="module")
def names() -> tuple[str, str]:
    return unique_queue("batch-priced"), unique_queue("batch-embedder")


@pytest.fixture(scope="module")
def stack(
    start_stack: Callable[..., Stack],
    names: tuple[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    generator, embedder = names
    files: Path = tmp_path_factory.mktemp("batch-usage-files")
    env = {
        "SAMPLING_MODELS": f"{generator}=simulated,{embedder}=simulated-embedder",
        "SAMPLING_QUEUE": generator, "SIMULATED_BATCH_MS": "50",
        "DATABASE_URL": migrated_database(ROOT, os.environ), "SAMPLING_FILES_DIR": str(files),
    }  # fmt: skip
    stack = start_stack("batch-usage", env=env, web_processes=2)
    manage(stack, "registermodel", generator, "--prompt-price", str(PROMPT_PRICE),
           "--completion-price", str(COMPLETION_PRICE), "--batch-price-factor", str(FACTOR),
           "--description", PRICED)  # fmt: skip
    yield stack
    manage(stack, "registermodel", generator, "--delete")


@pytest.fixture(scope="module")
def client(stack: Stack, names: tuple[str, str]) -> OpenAI:
    client = keyed_client(stack)
    generator, _ = names
    # The registration (its prices) reached the processes: the web processes answer with its
    # description, and the feeder polls the same catalog as often.
    wait_until(lambda: all((client.models.retrieve(generator).model_extra or {}).get(
        "description") == PRICED for _ in range(6)), what="the prices served")  # fmt: skip
    return client


def nanos_per_token(per_thousand: Decimal) -> Decimal:
    """The batch price of one token in billionths, rounded down as the service rounds it."""
    return (per_thousand * 1_000_000 * FACTOR).to_integral_value(rounding=ROUND_FLOOR)


def usage_of(stack: Stack, key: str, model: str) -> dict[str, str | int]:
    reply = request(stack.base_url, "/v1/usage", method="GET", headers=bearer(key))
    found = [m for m in json.loads(reply.body)["data"] if m["model"] == model]
    return {**found[0]["usage"], "spend": found[0]["spend"]} if found else {}


def test_a_job_s_tokens_are_its_key_s_usage_at_the_batch_price(
    stack: Stack, client: OpenAI, names: tuple[str, str]
) -> None:
    generator, _ = names
    lines = chat_lines(generator, 120, "priced")
    done = ended(client, create(client, lines).id)
    assert done.status == "completed", done
    bodies = [r["response"]["body"] for r in records(client, done.output_file_id)]
    assert len(bodies) == len(lines)
    prompt = sum(body["usage"]["prompt_tokens"] for body in bodies)
    completion = sum(body["usage"]["completion_tokens"] for body in bodies)
    assert prompt > 0
    assert completion > 0
    # The job's own usage, as OpenAI's batch object reports it.
    assert done.usage is not None
    assert (done.usage.input_tokens, done.usage.output_tokens) == (prompt, completion)
    assert done.usage.total_tokens == prompt + completion
    # Its key's usage and spend, exact: every token at the model's price times the factor.
    spend = (prompt * nanos_per_token(PROMPT_PRICE)
             + completion * nanos_per_token(COMPLETION_PRICE)) / Decimal(10**9)  # fmt: skip
    key = client.api_key
    wait_until(lambda: usage_of(stack, key, generator).get("completion_tokens") == completion,
               what="the job's tokens in /v1/usage")  # fmt: skip
    usage = usage_of(stack, key, generator)
    assert usage["prompt_tokens"] == prompt
    assert Decimal(str(usage["spend"])) == spend
    assert spend < (prompt * PROMPT_PRICE + completion * COMPLETION_PRICE) / 1000


def test_an_embeddings_job_answers_each_line_as_the_endpoint_does(
    client: OpenAI, names: tuple[str, str]
) -> None:
    _, embedder = names
    texts = [f"text number {index}" for index in range(30)]
    lines = [
        {
            "custom_id": f"e-{index}",
            "method": "POST",
            "url": EMBEDDINGS,
            "body": {"model": embedder, "input": text},
        }
        for index, text in enumerate(texts)
    ]
    lines.append({"custom_id": "two", "method": "POST", "url": EMBEDDINGS,
                  "body": {"model": embedder, "input": ["one", "two"]}})  # fmt: skip
    done = ended(client, create(client, lines, EMBEDDINGS).id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (30, 1)
    output = {r["custom_id"]: r["response"]["body"] for r in records(client, done.output_file_id)}
    interactive = client.embeddings.create(model=embedder, input=texts[:5])
    for index, answer in enumerate(interactive.data):
        body = output[f"e-{index}"]
        assert body["data"][0]["embedding"] == pytest.approx(answer.embedding, abs=1e-6)
        assert body["usage"]["prompt_tokens"] > 0
    errors = records(client, done.error_file_id)
    assert [e["custom_id"] for e in errors] == ["two"]
    assert errors[0]["response"]["status_code"] == 400
    assert errors[0]["response"]["body"]["error"]["param"] == "input"
