"""Prices, spend and monthly budgets against real processes (gunicorn with two web processes,
a Celery worker, the `openai` client): a key's spend in `/v1/usage` is exactly its answers'
tokens at the model's registered prices; a key with a monthly budget is refused with 429
`insufficient_quota` once its spend reaches it, within the documented delay and overshoot;
served again once its budget is raised. A burst of concurrent requests passes its budget by
one request's hold at most (each holds the most it may cost from admission)."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import openai
import pytest
from openai import OpenAI

from accounts.budgets import KEY_HELD, OWNER_SPENT, TEMPLATE_TOKENS
from devstack.stack import Stack
from tests.support import unique_queue
from tests.support.http import request
from tests.support.keys import bearer, create_key, known_everywhere
from tests.support.manage import manage
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

PROMPT_PRICE, COMPLETION_PRICE = Decimal("1.5"), Decimal("2.25")  # per 1,000 tokens
PRICED = "priced for the test"
# The refusal's delay (docs/guides/usage.md): one statistics flush (1 s) and one key poll
# (0.5 s) after the answer that reached the budget; and this test's own poll of its answers.
REFUSAL_WITHIN_S = 1.0 + 0.5 + 1.0


@pytest.fixture(scope="module")
def priced() -> str:
    return unique_queue("priced")


@pytest.fixture(scope="module")
def stack(start_stack: Callable[..., Stack], priced: str) -> Iterator[Stack]:
    # Keys required: a key a web process does not know yet is refused, not served anonymously.
    env = {"SAMPLING_MODELS": f"{priced}=simulated", "SAMPLING_QUEUE": priced,
           "SAMPLING_REQUIRE_API_KEY": "1"}  # fmt: skip
    stack = start_stack("budgets", env=env, web_processes=2)
    manage(stack, "registermodel", priced, "--prompt-price", str(PROMPT_PRICE),
           "--completion-price", str(COMPLETION_PRICE), "--description", PRICED)  # fmt: skip
    yield stack
    manage(stack, "registermodel", priced, "--delete")


def registered(client: OpenAI, model: str) -> bool:
    """Whether the registration (with its prices) reached the web processes: both answer
    with its description (the model is served before it, listed by SAMPLING_MODELS, free)."""
    return all(
        (client.models.retrieve(model).model_extra or {}).get("description") == PRICED
        for _ in range(6)
    )


def cost(usage: openai.types.CompletionUsage | None) -> Decimal:
    assert usage is not None
    tokens = PROMPT_PRICE * usage.prompt_tokens + COMPLETION_PRICE * usage.completion_tokens
    return tokens / 1000


def spend_of(stack: Stack, key: str) -> Decimal:
    reply = request(stack.base_url, "/v1/usage", method="GET", headers=bearer(key))
    return sum((Decimal(m["spend"]) for m in json.loads(reply.body)["data"]), Decimal(0))


def spend_until_refused(
    clients: list[OpenAI], model: str, budget: Decimal
) -> tuple[list[tuple[float, Decimal]], openai.RateLimitError]:
    """Completions from each client in turn until one is refused for its budget: every 200's
    (when, what it cost), and the refusal, which came within the documented delay after the
    answer that reached `budget`, with at most the documented overshoot."""
    answered: list[tuple[float, Decimal]] = []  # (when, what it cost) of every 200
    refusal: openai.RateLimitError | None = None
    for i in range(200):
        ask = functools.partial(_answer_or_refusal, clients[i % len(clients)], model, f"spend {i}")
        found = wait_until(ask, what="served or refused")
        if isinstance(found, openai.RateLimitError):
            refusal, refused_at = found, time.monotonic()
            break
        assert found is not None  # wait_until returns a truthy value
        answered.append((time.monotonic(), cost(found.usage)))
    assert refusal is not None, "never refused"
    assert (refusal.code, refusal.type) == ("insufficient_quota", "insufficient_quota")
    # When the budget was reached, and what came after it.
    total, reached_at, overshoot = Decimal(0), None, Decimal(0)
    for at, paid in answered:
        if reached_at is not None:
            overshoot += paid
        total += paid
        if reached_at is None and total >= budget:
            reached_at = at
    assert reached_at is not None
    assert refused_at - reached_at <= REFUSAL_WITHIN_S
    # The overshoot: the answers in that delay, the last one of the budget's own excepted.
    assert total - budget <= overshoot + answered[-1][1]
    return answered, refusal


def _answer_or_refusal(
    client: OpenAI, model: str, prompt: str
) -> openai.types.Completion | openai.RateLimitError | None:
    """A completion, or its refusal for the budget; None while the key's last answers still
    hold what is left of it (a 429 to try again, once their spend is counted)."""
    try:
        return client.completions.create(model=model, prompt=prompt)
    except openai.RateLimitError as exc:
        return None if exc.code == "rate_limit_exceeded" else exc


def served(client: OpenAI, model: str) -> bool:
    try:
        client.completions.create(model=model, prompt="again")
    except openai.RateLimitError:
        return False
    return True


def test_a_budget_refuses_its_key_once_spent_and_serves_it_again_when_raised(
    stack: Stack, priced: str
) -> None:
    budget = Decimal("0.05")  # about 6 answers of 8 tokens
    name = unique_queue("budgeted")
    key = create_key(stack, name, "--monthly-budget", str(budget))
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0)
    wait_until(lambda: known_everywhere(stack, key), what="the key in every web process")
    wait_until(lambda: registered(client, priced), what="the prices in every web process")
    answered, refusal = spend_until_refused([client], priced, budget)
    assert "budget" in refusal.message
    total = sum((paid for _, paid in answered), Decimal(0))
    # The spend is exact: the answers' tokens at the registered prices.
    wait_until(lambda: spend_of(stack, key) == total, what=f"spend {total} in /v1/usage")
    # A raised budget serves the key again, within a poll.
    manage(stack, "shell", "-c",
           "from operations.models import ApiKey; k = ApiKey.objects.get(name=" + repr(name)
           + "); k.monthly_budget = k.monthly_budget * 10; k.save()")  # fmt: skip
    wait_until(lambda: served(client, priced), what="served once the budget is raised")


def test_an_owner_s_budget_refuses_all_its_keys_once_they_spent_it_together(
    stack: Stack, priced: str
) -> None:
    owner, budget = unique_queue("owner"), Decimal("0.05")
    # The budget first: each key's record carries it from the key's first publication.
    manage(stack, "setownerbudget", owner, str(budget))
    keys = [create_key(stack, unique_queue("owned"), "--owner", owner) for _ in range(2)]
    other = create_key(stack, unique_queue("other owner"), "--owner", owner + "-not")
    clients = [OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0)
               for key in [*keys, other]]  # fmt: skip
    wait_until(
        lambda: all(known_everywhere(stack, key) for key in [*keys, other]), what="the keys known"
    )
    wait_until(lambda: registered(clients[0], priced), what="the prices in every web process")
    answered, refusal = spend_until_refused(clients[:2], priced, budget)
    assert isinstance(refusal.body, dict)
    assert refusal.body["message"] == OWNER_SPENT
    # Both keys spent, and their spend together is exactly what their answers cost.
    total = sum((paid for _, paid in answered), Decimal(0))
    wait_until(lambda: sum(spend_of(stack, key) for key in keys) == total, what="owner's spend")
    assert all(spend_of(stack, key) > 0 for key in keys)
    wait_until(lambda: not any(served(c, priced) for c in clients[:2]), what="both refused")
    assert served(clients[2], priced)  # another owner's key is not
    manage(stack, "setownerbudget", owner, str(budget * 10))
    wait_until(lambda: served(clients[1], priced), what="served once the budget is raised")


def test_spend_counts_per_model_and_keys_without_a_budget_are_never_refused(
    stack: Stack, priced: str
) -> None:
    key = create_key(stack, unique_queue("unbudgeted"))
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0)
    wait_until(lambda: known_everywhere(stack, key), what="the key in every web process")
    wait_until(lambda: registered(client, priced), what="the prices in every web process")
    total = sum(
        (cost(client.completions.create(model=priced, prompt=f"free {i}").usage)
         for i in range(40)), Decimal(0)
    )  # fmt: skip
    wait_until(lambda: spend_of(stack, key) == total, what=f"spend {total} in /v1/usage")
    reply = request(stack.base_url, "/v1/usage", method="GET", headers=bearer(key))
    assert [m["model"] for m in json.loads(reply.body)["data"]] == [priced]


def test_a_burst_passes_its_budget_by_one_request_s_hold_at_most(stack: Stack, priced: str) -> None:
    """Ten concurrent requests of 20 choices each: all would be admitted on the spend read
    before them (none yet). Each holds the most it may cost, so once the holds reach what is
    left the others get a 429 to try again, and the spend stays within the budget and one
    request's hold."""
    budget, n, max_tokens = Decimal("0.5"), 20, 8
    key = create_key(stack, unique_queue("burst"), "--monthly-budget", str(budget))
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0)
    wait_until(lambda: known_everywhere(stack, key), what="the key in every web process")
    wait_until(lambda: registered(client, priced), what="the prices in every web process")
    prompts = [f"burst {i}" for i in range(10)]

    def one(prompt: str) -> Decimal | openai.RateLimitError:
        try:
            reply = client.completions.create(model=priced, prompt=prompt, n=n,
                                              max_tokens=max_tokens)  # fmt: skip
        except openai.RateLimitError as exc:
            return exc
        return cost(reply.usage)

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(one, prompts))
    paid = [result for result in results if isinstance(result, Decimal)]
    refused = [result for result in results if not isinstance(result, Decimal)]
    assert paid, refused
    assert all(exc.code == "rate_limit_exceeded" for exc in refused), refused
    assert all(isinstance(exc.body, dict) and exc.body["message"] == KEY_HELD for exc in refused)
    total = sum(paid, Decimal(0))
    wait_until(lambda: spend_of(stack, key) == total, what=f"spend {total} in /v1/usage")
    prompt_bound = max(len(p.encode()) for p in prompts) + TEMPLATE_TOKENS
    hold = (PROMPT_PRICE * prompt_bound + COMPLETION_PRICE * max_tokens) * n / 1000
    assert total <= budget + hold
