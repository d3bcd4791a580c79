"""The OpenAI-compatible API and /api/inference, through the official `openai` client (sync,
async and streaming) and raw HTTP, against gunicorn, a real worker and Redis."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import redis
from openai import AsyncOpenAI, OpenAI

from batching.generation import RowSettings, render_chat_plain
from batching.keys import ShardKeys
from bench.harness import loadgen
from bench.harness.stalled import StalledWorker
from devstack.embedded_redis import free_port
from devstack.stack import Stack
from tests.support.http import request
from tests.support.waiting import wait_until
from workers.samplers.simulated import expected_completion, expected_row_completion

pytestmark = pytest.mark.integration

# The simulated sampler's tokens are whitespace-separated words.
DEFAULT_MAX_TOKENS = 32


def words(text: str) -> int:
    return len(text.split())


@pytest.fixture(scope="module")
def api(start_stack: Callable[..., Stack]) -> Stack:
    # These tests check what the API answers, not the deadline (test_service and the stalled
    # worker's test below do): a generous one keeps a burst of 31 requests on a 2-core machine,
    # shared with the suite's other stacks, from 504s that would say nothing about the API
    # (CI once saw one in the seed test's crowd).
    return start_stack("openai", env={"SAMPLER": "simulated", "SAMPLING_DEADLINE_MS": "5000"})


@pytest.fixture(scope="module")
def client(api: Stack) -> OpenAI:
    # No retries: a test sees each answer as the server gave it.
    return OpenAI(base_url=f"{api.base_url}/v1", api_key="not-checked", max_retries=0)


@pytest.fixture(scope="module")
def model(api: Stack) -> str:
    return api.env["SAMPLING_QUEUE"]


def test_completion(client: OpenAI, model: str) -> None:
    prompt = f"The speed of light {uuid.uuid4().hex[:6]} "
    completion = client.completions.create(model=model, prompt=prompt)
    expected = expected_completion(prompt)
    assert completion.object == "text_completion"
    assert completion.model == model
    assert completion.id.startswith("cmpl-")
    [choice] = completion.choices
    assert (choice.text, choice.index, choice.finish_reason) == (expected, 0, "stop")
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == words(prompt)
    assert completion.usage.completion_tokens == words(expected)
    assert completion.usage.total_tokens == words(prompt) + words(expected)


def test_a_list_prompt_and_n_are_items_of_their_own(client: OpenAI, model: str) -> None:
    prompts = [f"first {uuid.uuid4().hex[:6]}", f"second {uuid.uuid4().hex[:6]}"]
    completion = client.completions.create(model=model, prompt=prompts, n=3)
    assert [choice.index for choice in completion.choices] == list(range(6))
    # Greedy: every choice of a prompt is that prompt's completion, prompt-major.
    assert [choice.text for choice in completion.choices] == [
        expected_completion(prompt) for prompt in prompts for _ in range(3)
    ]
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == sum(words(p) for p in prompts)
    assert completion.usage.completion_tokens == 3 * sum(
        words(expected_completion(p)) for p in prompts
    )


def test_max_tokens_ends_with_length_and_echo_prepends_the_prompt(
    client: OpenAI, model: str
) -> None:
    prompt = f"limited {uuid.uuid4().hex[:6]}"
    completion = client.completions.create(model=model, prompt=prompt, max_tokens=2, echo=True)
    [choice] = completion.choices
    expected = " ".join(expected_completion(prompt).split(" ")[:2])
    assert (choice.text, choice.finish_reason) == (prompt + expected, "length")
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 2


def test_stop_strings_cut_the_completion(client: OpenAI, model: str) -> None:
    prompt = f"stopped {uuid.uuid4().hex[:6]}"
    full = expected_completion(prompt).split(" ")
    # full[3] is a digest's 6 hex digits: it cannot occur earlier in the three words.
    completion = client.completions.create(model=model, prompt=prompt, stop=["zzz", full[3]])
    [choice] = completion.choices
    assert choice.text == " ".join(full[:3]) + " "
    assert choice.finish_reason == "stop"


def test_a_seed_gives_the_same_completion_whatever_shares_the_batch(
    client: OpenAI, model: str
) -> None:
    prompt = f"seeded {uuid.uuid4().hex[:6]}"

    def seeded(seed: int) -> str:
        completion = client.completions.create(
            model=model, prompt=prompt, temperature=1.0, seed=seed
        )
        return completion.choices[0].text

    alone = seeded(7)
    # The same request among 30 others in flight, some sampled without a seed.
    with ThreadPoolExecutor(max_workers=31) as pool:
        crowd = [
            pool.submit(
                client.completions.create, model=model, prompt=f"{prompt} {i}", temperature=1.0
            )
            for i in range(30)
        ]
        again = pool.submit(seeded, 7)
        assert again.result() == alone
        failures = [repr(future.exception()) for future in crowd if future.exception()]
        assert not failures, failures
        assert all(future.result().choices for future in crowd)
    settings = RowSettings(max_tokens=DEFAULT_MAX_TOKENS, temperature=1.0, seed=7)
    assert alone == expected_row_completion(prompt, settings)[0]
    # Choice i of n draws with seed + i: n choices are not n copies.
    choices = client.completions.create(
        model=model, prompt=prompt, temperature=1.0, seed=7, n=2
    ).choices
    assert choices[0].text == alone
    settings = RowSettings(max_tokens=DEFAULT_MAX_TOKENS, temperature=1.0, seed=8)
    assert choices[1].text == expected_row_completion(prompt, settings)[0]


def test_chat_completion_renders_the_template_in_the_worker(client: OpenAI, model: str) -> None:
    messages = [("system", "Be brief."), ("user", f"What is E? {uuid.uuid4().hex[:6]}")]
    completion = client.chat.completions.create(
        model=model,
        messages=[{"role": role, "content": content} for role, content in messages],  # type: ignore[misc]
        max_completion_tokens=3,
    )
    rendered = render_chat_plain(tuple(messages))
    [choice] = completion.choices
    assert completion.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.message.content == " ".join(expected_completion(rendered).split(" ")[:3])
    assert choice.finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == words(rendered)


def test_streaming_completion_and_chat(client: OpenAI, model: str) -> None:
    prompt = f"streamed {uuid.uuid4().hex[:6]}"
    chunks = list(
        client.completions.create(
            model=model, prompt=prompt, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text == expected_completion(prompt)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == words(text)

    content = f"stream a chat {uuid.uuid4().hex[:6]}"
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], stream=True
    )
    deltas = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    rendered = render_chat_plain((("user", content),))
    assert "".join(deltas) == expected_completion(rendered)


def test_async_client(api: Stack, model: str) -> None:
    async def run() -> list[str]:
        async with AsyncOpenAI(
            base_url=f"{api.base_url}/v1", api_key="not-checked", max_retries=0
        ) as client:
            completions = await asyncio.gather(
                *(client.completions.create(model=model, prompt=f"async {i}") for i in range(20))
            )
            return [completion.choices[0].text for completion in completions]

    assert asyncio.run(run()) == [expected_completion(f"async {i}") for i in range(20)]


def test_models(client: OpenAI, model: str) -> None:
    listed = client.models.list().data
    assert [entry.id for entry in listed] == [model]
    served = client.models.retrieve(model)
    assert (served.id, served.object) == (model, "model")
    assert served.model_extra == {
        "root": "simulated", "workers": 1, "kind": "generator", "description": ""
    }  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


@pytest.mark.parametrize(
    ("settings", "param"),
    [
        ({"max_tokens": DEFAULT_MAX_TOKENS + 1}, "max_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"logprobs": 2}, "logprobs"),
        ({"best_of": 2}, "best_of"),
        ({"suffix": "after"}, "suffix"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"extra_body": {"top_k": 5}}, "top_k"),
        ({"prompt": [f"p{i}" for i in range(51)], "n": 2}, "n"),
    ],
)
def test_invalid_requests_raise_bad_request_naming_the_field(
    client: OpenAI, model: str, settings: dict[str, object], param: str
) -> None:
    arguments = {"model": model, "prompt": "E equals ", **settings}
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(**arguments)  # type: ignore[call-overload]
    assert raised.value.status_code == 400
    assert raised.value.param == param
    assert param in raised.value.message


def test_an_unknown_model_raises_not_found(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="gpt-5", prompt="E equals ")
    assert raised.value.code == "model_not_found"


def test_chat_with_tools_or_images_is_refused(client: OpenAI, model: str) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            tools=[tool],  # type: ignore[list-item]
        )
    assert raised.value.param == "tools"
    image = {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": [image]}],  # type: ignore[list-item,misc]
        )
    assert raised.value.param is not None
    assert raised.value.param.startswith("messages.0.content")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"", None),
        (b"[1, 2]", None),
        (b'{"prompt": "x", "max_tokens": "5"}', "max_tokens"),
        (b'{"prompt": "x", "max_tokens": true}', "max_tokens"),
        (b'{"prompt": "x", "n": 0}', "n"),
        (b'{"prompt": ""}', "prompt"),
        (b'{"prompt": [1, 2, 3]}', "prompt"),
        (b'{"prompt": "x", "stream": "yes"}', "stream"),
        (b"\xff\xfe", None),
    ],
)
def test_malformed_bodies_get_a_400_naming_the_problem(
    api: Stack, body: bytes, param: str | None
) -> None:
    reply = request(api.base_url, "/v1/completions", body=body)
    assert reply.status == 400, reply.body
    assert reply.headers["content-type"] == "application/json"
    error = json.loads(reply.body)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]


def test_an_oversize_body_is_refused_before_it_is_read(api: Stack) -> None:
    reply = request(
        api.base_url,
        "/v1/completions",
        body=b'{"prompt": "' + b"x" * (3 << 20) + b'"}',
        headers={"Content-Type": "application/json"},
    )
    assert reply.status == 400
    assert "limit" in json.loads(reply.body)["error"]["message"]


def test_a_prompt_over_the_policy_s_bytes_is_refused(client: OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=model, prompt=["ok", "x" * 9000])
    assert raised.value.param == "prompt.1"


def test_wrong_method_gets_405_with_allow(api: Stack) -> None:
    reply = request(api.base_url, "/v1/completions", method="GET")
    assert (reply.status, reply.headers["allow"]) == (405, "POST")
    reply = request(api.base_url, "/v1/models", body=b"{}")
    assert reply.status == 405


def test_api_inference(api: Stack) -> None:
    reply = request(api.base_url, "/api/inference", body=json.dumps({"input": "E equals "}))
    assert reply.status == 200
    answer = json.loads(reply.body)
    assert answer["output"] == "MC squared"
    assert len(answer["request_id"]) == 32
    assert 0 < answer["latency_ms"] < 500
    assert reply.headers["x-request-id"] == answer["request_id"]
    reply = request(api.base_url, "/api/inference", body=json.dumps({"prompt": "E equals "}))
    assert reply.status == 400
    assert json.loads(reply.body)["error"] == "INVALID_REQUEST"


def test_the_openapi_document_describes_every_endpoint(api: Stack) -> None:
    reply = request(api.base_url, "/v1/openapi.json", method="GET")
    document = json.loads(reply.body)
    assert set(document["paths"]) == {
        "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/models",
        "/v1/models/{model_id}", "/api/inference", "/v1/usage", "/v1/files",
        "/v1/files/{file_id}", "/v1/files/{file_id}/content", "/v1/batches",
        "/v1/batches/{batch_id}", "/v1/batches/{batch_id}/cancel",
    }  # fmt: skip


# --- the error classes the clients raise, from stacks that fail in each way --------------


def inference_error(stack: Stack, text: str) -> tuple[int, str, int | None, str | None]:
    """/api/inference's error for `text`: status, name, retry_after_ms, Retry-After."""
    reply = request(stack.base_url, "/api/inference", body=json.dumps({"input": text}))
    answer = json.loads(reply.body)
    assert answer["message"]
    return (
        reply.status,
        answer["error"],
        answer.get("retry_after_ms"),
        reply.headers.get("retry-after"),
    )


def test_a_failing_sampler_raises_a_502(start_stack: Callable[..., Stack]) -> None:
    stack = start_stack("openai-probe", env={"SAMPLER": "tests.support.probe_sampler:ProbeSampler"})
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="-", max_retries=0)
    with pytest.raises(openai.InternalServerError) as raised:
        client.completions.create(model=stack.env["SAMPLING_QUEUE"], prompt="raise: now")
    assert raised.value.status_code == 502
    assert raised.value.code == "sampler_failed"


def test_no_worker_raises_a_503_at_once_and_a_stalled_one_a_504_at_the_deadline(
    start_stack: Callable[..., Stack],
) -> None:
    deadline_ms = 300
    stack = start_stack("openai-idle", env={"SAMPLING_DEADLINE_MS": str(deadline_ms)}, gpus=[])
    queue = stack.env["SAMPLING_QUEUE"]
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="-", max_retries=0)
    # No worker heartbeats for the queue: refused at once, saying why.
    with pytest.raises(openai.InternalServerError) as raised:
        client.completions.create(model=queue, prompt="nobody home")
    assert (raised.value.status_code, raised.value.code) == (503, "model_unavailable")
    assert "no live worker" in raised.value.message
    status, name, retry_after_ms, retry_after = inference_error(stack, "nobody home")
    assert (status, name) == (503, "MODEL_UNAVAILABLE")
    assert retry_after_ms is not None
    assert retry_after == str(retry_after_ms // 1000)
    with StalledWorker(stack.env["REDIS_URL"], queue):
        # A worker that heartbeats and takes no batch: once the web process has read its
        # heartbeat, a request waits out its deadline.
        def error() -> openai.APIStatusError | None:
            with pytest.raises(openai.InternalServerError) as raised:
                client.completions.create(model=queue, prompt="nobody takes it")
            return None if raised.value.code == "model_unavailable" else raised.value

        late = wait_until(error, what="the stalled worker's heartbeat read")
        assert late is not None
        assert (late.status_code, late.code) == (504, "deadline_exceeded")
        # Admission's figure says a batch joined now finishes in 60 s (no worker recomputes
        # it here). The next request reads it with its append (and is admitted on the figure
        # its process read before: it gets its 504); from then on both APIs refuse at once.
        redis.Redis.from_url(stack.env["REDIS_URL"]).hset(
            ShardKeys(queue).admission, "predicted", 60_000
        )
        assert inference_error(stack, "nobody") == (504, "DEADLINE_EXCEEDED", None, None)
        with pytest.raises(openai.InternalServerError) as raised:
            client.completions.create(model=queue, prompt="too many")
        assert (raised.value.status_code, raised.value.code) == (503, "overloaded")
        assert raised.value.response.headers["retry-after"] == "60"
        assert inference_error(stack, "too many") == (503, "SERVICE_OVERLOADED", 60_000, "60")


def test_an_unreachable_queue_raises_a_503_with_retry_after(
    start_stack: Callable[..., Stack],
) -> None:
    dead_broker = f"redis://127.0.0.1:{free_port()}/0"
    stack = start_stack("openai-nobroker", env={"CELERY_BROKER_URL": dead_broker}, gpus=[])
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="-", max_retries=0)
    # No worker can reach the dead broker: one that heartbeats stands in for the workers of
    # a broker that just went away.
    with StalledWorker(stack.env["REDIS_URL"], stack.env["SAMPLING_QUEUE"]):
        wait_until(lambda: request(stack.base_url, "/readyz", method="GET").status == 200)
        with pytest.raises(openai.InternalServerError) as raised:
            client.chat.completions.create(
                model=stack.env["SAMPLING_QUEUE"], messages=[{"role": "user", "content": "hi"}]
            )
        assert (raised.value.status_code, raised.value.code) == (503, "queue_unavailable")
        assert raised.value.response.headers["retry-after"] == "1"
        assert inference_error(stack, "hi") == (503, "SERVICE_UNAVAILABLE", 1000, "1")


def test_the_load_generator_speaks_the_completions_api(api: Stack, model: str) -> None:
    """bench openai_load's own client: JSON in, each answer's text checked, constant arrivals."""
    protocol = loadgen.completions_protocol(model, 8)
    results = loadgen.run(
        "127.0.0.1", api.port, "/v1/completions", 40, 1.0, prompt=lambda i: f"load {i}",
        expected=expected_completion, protocol=protocol, constant=True,
    )  # fmt: skip
    assert results.sent == 40
    assert results.outcomes == ["ok"] * 40, results.examples
    assert results.intended_s == [i / 40 for i in range(40)]
