"""No prompt and no completion in any log, at any level: every process of a real stack logs at
DEBUG with gunicorn's access log on while requests of every kind pass (answered, refused,
failed by the sampler, malformed), then every log is searched for them."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable

import pytest

from devstack.stack import Stack
from tests.support.http import request, sample
from workers.samplers.simulated import expected_completion

pytestmark = pytest.mark.integration


def test_no_prompt_or_completion_in_any_log(start_stack: Callable[..., Stack]) -> None:
    stack = start_stack(
        "logs",
        env={
            "SAMPLER": "tests.support.probe_sampler:ProbeSampler",
            "LOG_LEVEL": "DEBUG",
            "WEB_ACCESS_LOG": "1",
            "SAMPLING_MAX_PROMPT_BYTES": "200",
        },
    )
    model = stack.env["SAMPLING_QUEUE"]  # the queue names the served model
    secret = f"private-{uuid.uuid4().hex}"  # appears in every prompt sent below
    answered = [f"{secret} answered {index}" for index in range(5)]
    completions = []
    for prompt in answered:
        reply = sample(stack.base_url, prompt)
        assert reply.status == 200, reply
        completions.append(reply.body)
    assert completions == [expected_completion(prompt) for prompt in answered]
    openai = request(
        stack.base_url, "/v1/completions",
        json.dumps({"model": model, "prompt": f"{secret} openai", "max_tokens": 4}),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    chat = request(
        stack.base_url, "/v1/chat/completions",
        json.dumps({"model": model, "messages": [{"role": "user", "content": f"{secret} chat"}]}),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    assert (openai.status, chat.status) == (200, 200), (openai, chat)
    completions += [json.loads(openai.body)["choices"][0]["text"],
                    json.loads(chat.body)["choices"][0]["message"]["content"]]  # fmt: skip
    refused = [
        sample(stack.base_url, f"{secret} too long " + "x" * 300),  # over the prompt limit
        sample(stack.base_url, f"raise:{secret} the sampler fails"),  # the call fails
        request(stack.base_url, "/v1/completions", f'{{"prompt": "{secret} broken json',
                headers={"Content-Type": "application/json"}),
        request(stack.base_url, "/v1/completions", json.dumps({"prompt": [f"{secret}", 3]}),
                headers={"Content-Type": "application/json"}),
    ]  # fmt: skip
    assert all(400 <= reply.status < 600 for reply in refused), refused
    time.sleep(1.5)  # a second's statistics flush and heartbeat logged too
    stack.stop()

    assert stack.log_dir is not None
    logs = {path.name: path.read_text(errors="replace") for path in stack.log_dir.glob("*.log")}
    text = "\n".join(logs.values())
    # The logs are there and as verbose as they get: debug lines, each request in the access
    # log, the failed call's error.
    assert "DEBUG" in text
    assert text.count("/sample") >= len(answered)
    assert "probe sampler asked to fail" in text
    for name, log in logs.items():
        assert secret not in log, f"a prompt in {name}"
        for completion in completions:
            assert completion not in log, f"a completion in {name}: {completion!r}"
