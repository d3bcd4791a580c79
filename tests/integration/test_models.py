"""Many models behind one endpoint, against real processes: two generators and an embedder
that SAMPLING_MODELS lists, each with its own worker (the generators' answers start with their
model's name), routed by the request's `model` through the `openai` client and plain HTTP; a
model registered with `manage.py registermodel` that has no worker; a worker that leaves and
comes back; an alias that splits 90/10, sticky per API key; an alias whose target's worker
dies, its users served by the other target (failover) and back."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from openai import OpenAI

from batching.embeddings import decode, shortened
from batching.registry import HEARTBEAT_TIMEOUT_MS
from devstack.stack import Stack
from tests.support import unique_queue
from tests.support.http import request
from tests.support.manage import manage
from tests.support.waiting import wait_until
from workers.samplers.embedder import SimulatedEmbedder, expected_embedding

pytestmark = pytest.mark.integration

NAMED = "tests.support.named_sampler:named"
DEADLINE_MS = 5000


@pytest.fixture(scope="module")
def models() -> tuple[str, str]:
    return unique_queue("alpha"), unique_queue("beta")


@pytest.fixture(scope="module")
def embedder() -> str:
    return unique_queue("embed")


@pytest.fixture(scope="module")
def stack(start_stack: Callable[..., Stack], models: tuple[str, str], embedder: str) -> Stack:
    alpha, beta = models
    env = {
        "SAMPLING_MODELS": f"{alpha}={NAMED},{beta}={NAMED},{embedder}=simulated-embedder",
        "SAMPLING_QUEUE": alpha,
        "SAMPLING_DEADLINE_MS": str(DEADLINE_MS),
    }
    return start_stack("models", env=env)


@pytest.fixture(scope="module")
def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key="-", max_retries=0)


@pytest.fixture
def idle_model(stack: Stack) -> Iterator[str]:
    """A registered model no worker serves; unregistered after the test."""
    name = unique_queue("idle")
    manage(stack, "registermodel", name, "--description", "no worker runs it")
    yield name
    manage(stack, "registermodel", name, "--delete")


def test_each_model_answers_with_its_own_sampler(client: OpenAI, models: tuple[str, str]) -> None:
    for model in models:
        completion = client.completions.create(model=model, prompt="E equals ")
        assert (completion.model, completion.choices[0].text) == (model, f"{model}: MC squared")
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.model == model
        assert (chat.choices[0].message.content or "").startswith(f"{model}: ")


def test_sample_and_inference_take_the_default_model_or_the_query_s(
    stack: Stack, models: tuple[str, str]
) -> None:
    alpha, beta = models
    assert request(stack.base_url, "/sample", "E equals ").body == f"{alpha}: MC squared"
    reply = request(stack.base_url, f"/sample?model={beta}", "E equals ")
    assert (reply.status, reply.body) == (200, f"{beta}: MC squared")
    reply = request(stack.base_url, f"/api/inference?model={beta}", json.dumps({"input": "x"}))
    assert json.loads(reply.body)["output"].startswith(f"{beta}: ")


def test_the_models_list_shows_each_model_with_its_live_worker(
    client: OpenAI, models: tuple[str, str], embedder: str
) -> None:
    listed = {entry.id: entry for entry in client.models.list().data}
    for model, kind in [(models[0], "generator"), (models[1], "generator"), (embedder, "embedder")]:
        assert listed[model].owned_by
        assert listed[model].created > 0
        assert (listed[model].model_extra or {})["workers"] == 1
        assert (listed[model].model_extra or {})["kind"] == kind


def test_embeddings_are_the_model_s_vectors_whatever_shares_the_batch(
    client: OpenAI, embedder: str
) -> None:
    texts = [f"text {i}" for i in range(8)]
    one = client.embeddings.create(model=embedder, input="text 3")
    assert (one.model, one.usage.prompt_tokens) == (embedder, 2)
    assert one.data[0].embedding == pytest.approx(expected_embedding("text 3"), abs=1e-6)
    # The same text, alone, in a list, and in requests sent at once (other batch members).
    with ThreadPoolExecutor(8) as pool:
        crowd = list(pool.map(lambda t: client.embeddings.create(model=embedder, input=t), texts))
    listed = client.embeddings.create(model=embedder, input=texts)
    assert [d.index for d in listed.data] == list(range(8))
    for index, text in enumerate(texts):
        assert len(listed.data[index].embedding) == SimulatedEmbedder.dimensions
        assert listed.data[index].embedding == crowd[index].data[0].embedding
        assert listed.data[index].embedding == pytest.approx(expected_embedding(text), abs=1e-6)
    assert listed.data[3].embedding == one.data[0].embedding
    raw = client.embeddings.with_raw_response.create(
        model=embedder, input="text 3", encoding_format="base64"
    )
    encoded = json.loads(raw.text)["data"][0]["embedding"]
    assert decode(encoded) == one.data[0].embedding
    short = client.embeddings.create(model=embedder, input="text 3", dimensions=16)
    assert short.data[0].embedding == pytest.approx(shortened(one.data[0].embedding, 16), abs=1e-6)


def test_each_endpoint_refuses_a_model_of_the_other_kind(
    client: OpenAI, models: tuple[str, str], embedder: str
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=embedder, prompt="x")
    assert (raised.value.code, raised.value.param) == ("model_not_supported", "model")
    with pytest.raises(openai.BadRequestError) as raised:
        client.embeddings.create(model=models[0], input="x")
    assert raised.value.code == "model_not_supported"
    with pytest.raises(openai.BadRequestError) as raised:
        client.embeddings.create(model=embedder, input="x", dimensions=65)
    assert raised.value.code == "prompt_rejected"
    assert "dimensions 65" in raised.value.message


def test_an_unknown_model_is_not_found_on_every_endpoint(stack: Stack, client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="no-such-model", prompt="x")
    assert raised.value.code == "model_not_found"
    assert request(stack.base_url, "/sample?model=no-such-model", "x").status == 404
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_a_model_without_a_worker_is_refused_at_once_saying_so(
    stack: Stack, client: OpenAI, idle_model: str
) -> None:
    def refused() -> openai.APIStatusError | None:
        try:
            client.completions.create(model=idle_model, prompt="anyone?")
        except openai.NotFoundError:
            return None  # the registration has not reached this process yet
        except openai.APIStatusError as exc:
            return exc
        raise AssertionError("a model with no worker answered")

    error = wait_until(refused, what="the registered model reaches the web process")
    assert error is not None
    assert (error.status_code, error.code) == (503, "model_unavailable")
    assert idle_model in error.message
    assert int(error.response.headers["retry-after"]) >= 1
    # Answered from memory, not at the deadline: far inside it.
    reply = request(stack.base_url, f"/sample?model={idle_model}", "anyone?")
    assert reply.status == 503
    assert reply.seconds < DEADLINE_MS / 1000 / 10
    assert idle_model not in {entry.id for entry in client.models.list().data}
    assert (client.models.retrieve(idle_model).model_extra or {})["workers"] == 0


def test_a_model_whose_worker_left_is_refused_until_one_is_back(
    stack: Stack, client: OpenAI, models: tuple[str, str]
) -> None:
    beta = models[1]
    index = next(i for i, model in enumerate(stack.worker_models) if model and model[0] == beta)
    stack.stop_process(stack.workers[index])  # SIGTERM: the worker says goodbye

    def status() -> int:
        try:
            client.completions.create(model=beta, prompt="E equals ")
        except openai.APIStatusError as exc:
            return exc.status_code
        return 200

    wait_until(lambda: status() == 503, what="the web process sees beta without a worker")
    stack.restart_worker(index)
    wait_until(lambda: status() == 200, timeout_s=60, what="beta served again")
    assert client.completions.create(model=models[0], prompt="E equals ").model == models[0]


KEYS_SCRIPT = """
import json
from operations.models import ApiKey, Tier, publish_access
tier = Tier.objects.get(name="free")
keys = [ApiKey(name="{prefix}" + str(i), tier=tier, rpm=0, tpm=0) for i in range({count})]
raws = [key.issue() for key in keys]
ApiKey.objects.bulk_create(keys, batch_size=500)
publish_access()
print(json.dumps(raws))
"""
DROP_KEYS_SCRIPT = """
from operations.models import ApiKey, publish_access
ApiKey.objects.filter(name__startswith="{prefix}").delete()
publish_access()
"""


@pytest.fixture
def many_keys(stack: Stack) -> Iterator[list[str]]:
    """5,000 API keys of their own (no limits), deleted after the test."""
    prefix = unique_queue("split-key") + "-"
    printed = manage(stack, "shell", "-c", KEYS_SCRIPT.format(prefix=prefix, count=5000))
    raws = json.loads(printed.strip().splitlines()[-1])
    yield raws
    manage(stack, "shell", "-c", DROP_KEYS_SCRIPT.format(prefix=prefix))


def alias_of(stack: Stack, models: tuple[str, str], weights: tuple[int, int]) -> Iterator[str]:
    """An alias splitting between alpha and beta by `weights`, removed after."""
    alias = unique_queue("split")
    for model in models:
        manage(stack, "registermodel", model)
    manage(stack, "setalias", alias, *(f"{m}={w}" for m, w in zip(models, weights, strict=True)))
    yield alias
    manage(stack, "setalias", alias, "--delete")
    for model in models:
        manage(stack, "registermodel", model, "--delete")


@pytest.fixture
def split(stack: Stack, models: tuple[str, str]) -> Iterator[str]:
    """An alias sending 90% of its requests to alpha and 10% to beta."""
    yield from alias_of(stack, models, (90, 10))


def test_an_alias_splits_by_weight_and_keeps_each_key_on_one_model(
    stack: Stack, models: tuple[str, str], split: str, many_keys: list[str]
) -> None:
    def served_by(key: str, prompt: str) -> str:
        reply = request(
            stack.base_url, "/v1/completions", json.dumps({"model": split, "prompt": prompt}),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )  # fmt: skip
        assert reply.status == 200, reply.body
        return str(json.loads(reply.body)["model"])

    # The keys and the alias have reached the web process: a key's usage is its own.
    usage = f"{stack.base_url}/v1/usage"
    wait_until(
        lambda: request(stack.base_url, "/v1/usage", method="GET",
                        headers={"Authorization": f"Bearer {many_keys[-1]}"}).status == 200,
        what=f"the keys published ({usage})",
    )  # fmt: skip
    wait_until(lambda: split in {m.id for m in OpenAI(base_url=f"{stack.base_url}/v1",
               api_key="-").models.list().data}, what="the alias published")  # fmt: skip
    with ThreadPoolExecutor(32) as pool:
        picks = list(pool.map(lambda key: served_by(key, "E equals "), many_keys))
    assert set(picks) == set(models)
    share = picks.count(models[1]) / len(picks)
    assert abs(share - 0.10) <= 0.02, share
    for key in many_keys[:10]:
        with ThreadPoolExecutor(20) as pool:
            seen = set(pool.map(lambda i, key=key: served_by(key, f"again {i}"), range(20)))
        assert len(seen) == 1, (key[:11], seen)


@pytest.fixture
def halves(stack: Stack, models: tuple[str, str]) -> Iterator[str]:
    """An alias sending half its users to alpha and half to beta."""
    yield from alias_of(stack, models, (50, 50))


def test_a_dead_targets_users_fail_over_within_the_heartbeat_timeout_and_come_back(
    stack: Stack, client: OpenAI, models: tuple[str, str], halves: str
) -> None:
    alpha, beta = models

    def served(user: str) -> str | None:
        try:
            return client.completions.create(model=halves, prompt="E equals ", user=user).model
        except openai.APIStatusError:
            return None

    wait_until(lambda: halves in {m.id for m in client.models.list().data}, what="published")
    users = [f"user-{i}" for i in range(40)]
    first = {user: served(user) for user in users}
    on_beta = [user for user in users if first[user] == beta]
    assert on_beta
    assert len(on_beta) < len(users)
    index = next(i for i, m in enumerate(stack.worker_models) if m and m[0] == beta)
    stack.stop_process(stack.workers[index], signal.SIGKILL)  # a crash: no goodbye
    killed = time.monotonic()
    probes: list[tuple[float, str | None]] = []

    def probe() -> None:
        sent = time.monotonic() - killed
        probes.append((sent, served(on_beta[0])))

    try:
        senders = []
        while time.monotonic() - killed < HEARTBEAT_TIMEOUT_MS / 1000 + 4:
            senders.append(threading.Thread(target=probe))
            senders[-1].start()
            time.sleep(0.2)  # a probe's pace, not a wait for a condition
        for sender in senders:
            sender.join()
        failed_over = [sent for sent, model in probes if model != alpha]
        moved_at = max(failed_over, default=0.0)
        assert moved_at <= HEARTBEAT_TIMEOUT_MS / 1000 + 1, sorted(probes)
        assert {served(user) for user in on_beta} == {alpha}
        assert all(served(user) == alpha for user in users if first[user] == alpha)
    finally:
        stack.restart_worker(index)
    wait_until(lambda: served(on_beta[0]) == beta, timeout_s=60, what="beta's users back")
    assert {user: served(user) for user in users} == first
