"""End to end with the real default model: gunicorn, a Celery worker with SAMPLER=hf loading
the packaged SmolLM2 GGUF on CPU, and Redis. The answers must be the ones the same model gives
in this process, prompt by prompt."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from batching.generation import Completion, Row, RowSettings
from devstack.stack import Stack
from tests.support.batches import ended, jsonl, keyed_client, records
from tests.support.http import sample
from tests.support.worker import worker_output_at_exit
from workers.samplers.base import GenerationSettings
from workers.samplers.hf import HFSampler

pytestmark = pytest.mark.integration

CONTEXT_TOKENS = 8192  # SmolLM2-135M


@pytest.fixture(scope="module")
def model_service(
    start_stack: Callable[..., Stack], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    env = {
        "SAMPLING_FILES_DIR": str(tmp_path_factory.mktemp("files")),  # offline jobs' files
        "SAMPLER": "hf",
        "SAMPLING_MODEL": "",  # the packaged GGUF
        "SAMPLING_MAX_NEW_TOKENS": "8",
        # CPU: a batch takes seconds, not the GPU's 100 ms, and more with more prompts (as in
        # make run's CPU profile).
        "SAMPLING_DEADLINE_MS": "60000",
        "SAMPLING_CALL_TIMEOUT_MS": "60000",
        # Let a prompt past the model's context reach the worker, to be rejected there.
        "SAMPLING_MAX_PROMPT_BYTES": "100000",
    }
    stack = start_stack("smollm2", env=env, timeout_s=240)
    yield stack
    stack.stop()  # frees its cores and memory for the timing-sensitive tests that follow


def test_curl_e_equals_returns_what_smollm2_writes(
    model_service: Stack, smollm2: HFSampler
) -> None:
    reply = sample(model_service.base_url, "E equals ", timeout=60)
    assert reply.status == 200, reply.body
    assert reply.body == smollm2.batched_sample(["E equals "])[0]
    assert reply.body.strip()


def test_concurrent_prompts_get_their_own_completions_and_a_too_long_one_a_400(
    model_service: Stack, smollm2: HFSampler
) -> None:
    prompts = ["The capital of France is", "Once upon a time", "word " * (CONTEXT_TOKENS + 10)]
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        replies = list(pool.map(lambda p: sample(model_service.base_url, p, timeout=60), prompts))
    assert [r.status for r in replies] == [200, 200, 400], [r.body for r in replies]
    assert [r.body for r in replies[:2]] == smollm2.batched_sample(prompts[:2])
    assert replies[2].body.startswith("prompt rejected by the model: prompt is ")
    assert f"at most {CONTEXT_TOKENS - 8} fit" in replies[2].body


def test_the_openai_client_gets_smollm2_row_by_row_with_its_chat_template(
    model_service: Stack, smollm2: HFSampler
) -> None:
    """A chat rendered by the worker's tokenizer and a completion with settings of its own,
    sharing one batch: each is what the same model gives that request alone."""
    client = OpenAI(base_url=f"{model_service.base_url}/v1", api_key="-", max_retries=0,
                    timeout=60)  # fmt: skip
    model = model_service.env["SAMPLING_QUEUE"]
    chat = (("system", "Answer in one word."), ("user", "What is the capital of France?"))
    prompt = "The capital of France is"
    with ThreadPoolExecutor(max_workers=2) as pool:
        chatted = pool.submit(
            client.chat.completions.create,  # type: ignore[arg-type]
            model=model,
            messages=[{"role": role, "content": content} for role, content in chat],
        )
        completed = pool.submit(
            client.completions.create, model=model, prompt=prompt, max_tokens=4,
            temperature=0.7, seed=3,
        )  # fmt: skip
        chat_answer, completion = chatted.result(), completed.result()
    # The same model on the worker's device: this stack's worker runs on the CPU in float32,
    # and a seeded draw from a GPU's bf16 logits is another draw.
    if smollm2.device != "cpu":
        smollm2 = HFSampler("", GenerationSettings(max_new_tokens=8), device="cpu")
    rendered = smollm2.render_chat(chat)
    [alone] = smollm2.batched_complete([Row(rendered, smollm2.row_settings(), templated=True)])
    assert isinstance(alone, Completion)
    assert chat_answer.choices[0].message.content == alone.text
    assert chat_answer.usage is not None
    assert chat_answer.usage.prompt_tokens == alone.prompt_tokens
    assert chat_answer.usage.completion_tokens == alone.completion_tokens
    settings = RowSettings(max_tokens=4, temperature=0.7, seed=3)
    [alone] = smollm2.batched_complete([Row(prompt, settings)])
    assert isinstance(alone, Completion)
    assert (completion.choices[0].text, completion.choices[0].finish_reason) == (
        alone.text,
        str(alone.finish_reason),
    )


def test_a_worker_whose_model_cannot_load_exits(redis_url: str, tmp_path: Path) -> None:
    """Celery swallows a worker_process_init handler's exception; the worker must not go on
    consuming batches it cannot run."""
    missing = tmp_path / "no-such-model"
    status, output = worker_output_at_exit(
        redis_url, "noload", SAMPLER="hf", SAMPLING_MODEL=str(missing)
    )
    assert status != 0, output[-2000:]
    assert "the sampler could not be loaded, exiting" in output
    assert f"no model at {missing}" in output


def test_streamed_answers_equal_whole_ones_in_a_mixed_batch(model_service: Stack) -> None:
    """Streaming and whole requests of the same prompts, settings and seed, sent together
    (they share batches): each stream's chunks, joined, are the whole answer, multi-byte
    characters and stop strings included."""
    client = OpenAI(
        base_url=f"{model_service.base_url}/v1", api_key="-", max_retries=0, timeout=120
    )
    model = model_service.env["SAMPLING_QUEUE"]
    prompts = ["Le café est", "日本の首都は", "Once upon a time", "E equals "]

    def whole(prompt: str) -> str:
        completion = client.completions.create(
            model=model, prompt=prompt, max_tokens=8, temperature=0.9, seed=11, stop=[".", "\n\n"]
        )
        return completion.choices[0].text

    def streamed(prompt: str) -> str:
        chunks = client.completions.create(
            model=model, prompt=prompt, max_tokens=8, temperature=0.9, seed=11,
            stop=[".", "\n\n"], stream=True,
        )  # fmt: skip
        return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)

    with ThreadPoolExecutor(max_workers=2 * len(prompts)) as pool:
        wholes = [pool.submit(whole, prompt) for prompt in prompts]
        streams = [pool.submit(streamed, prompt) for prompt in prompts]
        answers = [(w.result(), s.result()) for w, s in zip(wholes, streams, strict=True)]
    assert all(w == s for w, s in answers), answers
    assert any(w for w, _ in answers)


def test_a_batch_of_smollm2_lines_answers_as_requests_do(model_service: Stack) -> None:
    """The Batch API with the real model: each line's answer is the one the same request gets
    interactively, for the same seed and settings."""
    client = keyed_client(model_service)
    client = client.with_options(timeout=120)
    model = model_service.env["SAMPLING_QUEUE"]
    prompts = ["Le café est", "日本の首都は", "Once upon a time", "E equals "]
    bodies: list[dict[str, Any]] = [
        {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.9,
         "seed": 11 + index, "stop": [".", "\n\n"]}
        for index, prompt in enumerate(prompts)
    ]  # fmt: skip
    lines = [{"custom_id": f"smol-{i}", "method": "POST", "url": "/v1/completions", "body": body}
             for i, body in enumerate(bodies)]  # fmt: skip
    uploaded = client.files.create(file=("smol.jsonl", jsonl(lines)), purpose="batch")
    job = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                completion_window="24h")  # fmt: skip
    done = ended(client, job.id, timeout_s=240)
    assert done.status == "completed", done
    output = {r["custom_id"]: r["response"]["body"] for r in records(client, done.output_file_id)}
    for index, body in enumerate(bodies):
        interactive = client.completions.create(
            model=model, prompt=body["prompt"], max_tokens=8, temperature=0.9,
            seed=body["seed"], stop=body["stop"],
        )  # fmt: skip
        assert output[f"smol-{index}"]["choices"][0]["text"] == interactive.choices[0].text
