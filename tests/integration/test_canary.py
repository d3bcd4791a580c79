"""Canaries rolled back by the service itself, against real processes: two aliases split
50/50 between one stable model and a canary each, one canary failing one prompt in five (a
sampler that fails rows, not whole calls), the other healthy; the same traffic to both until
the bad one is rolled back; the healthy one is still served after as much traffic again."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator

import openai
import pytest
from openai import OpenAI

from inference_site.lib.stack import Stack
from tests.support import ADMIN_PASSWORD, ADMIN_USER, unique_queue
from tests.support.admin_client import AdminSession
from tests.support.manage import manage
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

WINDOW_S = 20
MIN_REQUESTS = 60
# The rule's window, one judgement (every 5 to 10 s) and a statistics flush.
ROLLBACK_WITHIN_S = WINDOW_S + 10 + 2


@pytest.fixture(scope="module")
def names() -> dict[str, str]:
    return {
        role: unique_queue(role) for role in ("stable", "bad", "good", "bad-split", "good-split")
    }


@pytest.fixture(scope="module")
def stack(start_stack: Callable[..., Stack], names: dict[str, str]) -> Iterator[Stack]:
    support = "tests.support.named_sampler"
    env = {
        "SAMPLING_MODELS": f"{names['stable']}={support}:named,{names['bad']}={support}:flaky,"
        f"{names['good']}={support}:named",
        "SAMPLING_QUEUE": names["stable"],
        "SAMPLING_DEADLINE_MS": "5000",
        "SAMPLING_CANARY_WINDOW_S": str(WINDOW_S),
        "SAMPLING_CANARY_MIN_REQUESTS": str(MIN_REQUESTS),
    }
    stack = start_stack("canary", env=env, web_processes=2)
    for role in ("stable", "bad", "good"):
        manage(stack, "registermodel", names[role])
    for canary in ("bad", "good"):
        manage(stack, "setalias", names[f"{canary}-split"], f"{names['stable']}=50",
               f"{names[canary]}=50:canary")  # fmt: skip
    yield stack
    for canary in ("bad", "good"):
        manage(stack, "setalias", names[f"{canary}-split"], "--delete")
    for role in ("stable", "bad", "good"):
        manage(stack, "registermodel", names[role], "--delete")


def test_a_failing_canary_is_rolled_back_and_a_healthy_one_is_not(
    stack: Stack, names: dict[str, str]
) -> None:
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="-", max_retries=0)
    aliases = [names["bad-split"], names["good-split"]]

    def targets(alias: str) -> list[str]:
        try:
            return (client.models.retrieve(alias).model_extra or {})["targets"]
        except openai.NotFoundError:
            return []  # not yet in the catalog of the web process that answered

    wait_until(lambda: all(len(targets(a)) == 2 for a in aliases), what="both splits served")
    stop = threading.Event()
    served: dict[str, set[str]] = {alias: set() for alias in aliases}
    sent = dict.fromkeys(aliases, 0)

    def traffic(alias: str) -> None:  # anonymous, no `user`: split per request
        for i in range(1_000_000):
            if stop.is_set():
                return
            sent[alias] += 1
            try:
                answer = client.completions.create(model=alias, prompt=f"{alias} {i}")
                served[alias].add(answer.model)
            except Exception:  # noqa: BLE001, S112 - the bad canary's 502s are the point
                continue

    senders = [threading.Thread(target=traffic, args=(alias,)) for alias in aliases for _ in "ab"]
    for sender in senders:
        sender.start()
    try:
        wait_until(
            lambda: names["bad"] not in targets(aliases[0]),
            ROLLBACK_WITHIN_S + 30,
            "the failing canary rolled back",
        )
        # The healthy canary gets as much traffic again as its alias had by then.
        trial = 2 * sent[aliases[1]]
        wait_until(lambda: sent[aliases[1]] >= trial, ROLLBACK_WITHIN_S + 30, "the same again")
        assert set(targets(aliases[1])) == {names["stable"], names["good"]}
    finally:
        stop.set()
        for sender in senders:
            sender.join()
    assert served[aliases[1]] == {names["stable"], names["good"]}
    printed = manage(
        stack,
        "shell",
        "-c",
        "import json; from operations.canary import "
        "recent_rollbacks; print(json.dumps([c.details for c in recent_rollbacks(20)]))",
    )
    history = json.loads(printed.strip().splitlines()[-1])
    ours = [d for d in history if d["alias"] in aliases]
    assert [d["model"] for d in ours] == [names["bad"]]
    why = ours[0]
    assert why["measure"] == "on-time rate"
    assert why["canary"]["requests"] >= MIN_REQUESTS
    assert why["canary"]["on_time_rate"] < why["baseline"]["on_time_rate"] - 0.05
    assert why["baseline"]["models"] == [names["stable"]]
    assert why["z"] > 3
    # Requests to the alias now go to the stable model only.
    assert {client.completions.create(model=aliases[0], prompt=f"after {i}").model
            for i in range(10)} == {names["stable"]}  # fmt: skip
    admin = AdminSession(stack.base_url)
    admin.login(ADMIN_USER, ADMIN_PASSWORD)
    _, page = admin.get("/admin/stats/")
    assert f"rolled back canary {names['bad']}" in page
