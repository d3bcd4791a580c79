"""Canaries rolled back by the service itself, against real processes: two aliases split
50/50 between one stable model and a canary each, one canary failing one prompt in five (a
sampler that fails rows, not whole calls), the other healthy; the same traffic to both until
the bad one is rolled back, its failed requests retried on the stable model (counted on
both); the healthy one is still served after as much traffic again. A
third canary's worker stops, with failover off: its 503s are counted on it, and its trial
pauses rather than rolling it back, its ramp held. The healthy canary's ramp doubles its
weight as its trial watches it."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from openai import OpenAI

from devstack.stack import Stack
from tests.support import ADMIN_PASSWORD, ADMIN_USER, unique_queue
from tests.support.admin_client import AdminSession
from tests.support.manage import manage
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

WINDOW_S = 20
MIN_REQUESTS = 60
# The clusters a verdict needs, the last one's end, one judgement (every 5 to 10 s) and the
# flush lag: a canary failing one request in five at several requests/s is found by then.
ROLLBACK_WITHIN_S = WINDOW_S + 10 + 10 + 3
# A canary with a ramp doubles its weight after this long watched.
RAMP_EVERY_S = 10


@pytest.fixture(scope="module")
def names() -> dict[str, str]:
    return {
        role: unique_queue(role)
        for role in ("stable", "bad", "good", "dead", "bad-split", "good-split", "dead-split")
    }


@pytest.fixture(scope="module")
def stack(start_stack: Callable[..., Stack], names: dict[str, str]) -> Iterator[Stack]:
    support = "tests.support.named_sampler"
    env = {
        "SAMPLING_MODELS": f"{names['stable']}={support}:named,{names['bad']}={support}:flaky,"
        f"{names['good']}={support}:named,{names['dead']}={support}:named",
        "SAMPLING_ALIAS_FAILOVER": "0",
        "SAMPLING_CANARY_RAMP_EVERY_S": str(RAMP_EVERY_S),
        "SAMPLING_QUEUE": names["stable"],
        "SAMPLING_DEADLINE_MS": "5000",
        "SAMPLING_CANARY_WINDOW_S": str(WINDOW_S),
        "SAMPLING_CANARY_MIN_REQUESTS": str(MIN_REQUESTS),
    }
    stack = start_stack("canary", env=env, web_processes=2)
    for role in ("stable", "bad", "good", "dead"):
        manage(stack, "registermodel", names[role])
    canaries = {"bad": "50:canary", "good": "20:canary:ramp=80", "dead": "10:canary:ramp=40"}
    for canary, split in canaries.items():
        manage(stack, "setalias", names[f"{canary}-split"], f"{names['stable']}=50",
               f"{names[canary]}={split}")  # fmt: skip
    yield stack
    for canary in ("bad", "good", "dead"):
        manage(stack, "setalias", names[f"{canary}-split"], "--delete")
    for role in ("stable", "bad", "good", "dead"):
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
    failed = dict.fromkeys(aliases, 0)

    def traffic(alias: str) -> None:  # anonymous, no `user`: split per request
        for i in range(1_000_000):
            if stop.is_set():
                return
            sent[alias] += 1
            try:
                answer = client.completions.create(model=alias, prompt=f"{alias} {i}")
                served[alias].add(answer.model)
            except openai.APIError:
                failed[alias] += 1

    senders = [threading.Thread(target=traffic, args=(alias,)) for alias in aliases for _ in "ab"]
    started = time.monotonic()
    for sender in senders:
        sender.start()
    try:
        wait_until(
            lambda: names["bad"] not in targets(aliases[0]),
            ROLLBACK_WITHIN_S + 30,
            "the failing canary rolled back",
        )
        # The healthy canary gets as much traffic again as its alias had by then (slower: the
        # stable model's one worker now serves three quarters of it).
        trial, took_s = 2 * sent[aliases[1]], time.monotonic() - started
        wait_until(lambda: sent[aliases[1]] >= trial, 4 * took_s + 30, "the same again")
        # Watched with nothing worse, the healthy canary's ramp doubles its weight: 20, 40, 80.
        wait_until(lambda: ramps(stack, aliases[1]) == [20, 40], 4 * took_s + 30, "its ramp")
        assert set(targets(aliases[1])) == {names["stable"], names["good"]}
    finally:
        stop.set()
        for sender in senders:
            sender.join()
    assert served[aliases[1]] == {names["stable"], names["good"]}
    # The bad canary failed one in five of its half: each was sent again to the stable model.
    assert failed[aliases[0]] < 0.02 * sent[aliases[0]], (failed, sent)
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
    readings = {reading["measure"]: reading for reading in why["readings"]}
    errors = readings["errors"]
    assert errors["canary_rate"] > errors["baseline_rate"] + why["rule"]["margin"]
    assert max(r["log_evidence"] for r in readings.values()) >= why["threshold"]
    assert why["baseline"] == [names["stable"]]
    # Requests to the alias now go to the stable model only.
    assert {client.completions.create(model=aliases[0], prompt=f"after {i}").model
            for i in range(10)} == {names["stable"]}  # fmt: skip
    admin = AdminSession(stack.base_url)
    admin.login(ADMIN_USER, ADMIN_PASSWORD)
    _, page = admin.get("/admin/stats/")
    assert f"rolled back canary {names['bad']}" in page


RAMPS_SCRIPT = """
import json
from operations.models import CatalogChange
ramps = CatalogChange.objects.filter(details__kind="canary ramp", details__alias="{alias}")
print(json.dumps([change.details["weight_was"] for change in ramps.order_by("id")]))
"""


def ramps(stack: Stack, alias: str) -> list[int]:
    """The weights a canary's ramp stepped up from, in order."""
    printed = manage(stack, "shell", "-c", RAMPS_SCRIPT.format(alias=alias))
    return list(json.loads(printed.strip().splitlines()[-1]))


FIGURES_SCRIPT = """
import json, time
from telemetry import stats
from serving.redis_client import redis_client
from operations.models import AliasTarget, CanaryTrial
now = int(time.time())
def total(model):
    buckets = stats.read_buckets(redis_client(), model, stats.SECOND, now - 600, now + 1)
    return stats.merge(counts for _, counts in buckets)
trial = CanaryTrial.objects.filter(alias="{alias}", model="{dead}").first()
print(json.dumps({{
    "no_worker": {{m: total(m)[stats.NO_WORKER] for m in ("{dead}", "{stable}")}},
    "errors": total("{dead}")["req:error"],
    "state": trial.state if trial else None,
    "weight": AliasTarget.objects.get(alias__name="{alias}", model__name="{dead}").weight,
}}))
"""


NO_WORKER = (503, "model_unavailable")


def test_a_canary_without_a_worker_is_refused_counted_on_it_and_paused(
    stack: Stack, names: dict[str, str]
) -> None:
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="-", max_retries=0)
    alias, dead = names["dead-split"], names["dead"]
    wait_until(lambda: alias in {m.id for m in client.models.list().data}, what="the split served")
    index = next(i for i, m in enumerate(stack.worker_models) if m and m[0] == dead)
    stack.stop_process(stack.workers[index])  # SIGTERM: the worker says goodbye
    script = FIGURES_SCRIPT.format(alias=alias, dead=dead, stable=names["stable"])

    def figures() -> dict[str, Any]:
        found = dict(json.loads(manage(stack, "shell", "-c", script).strip().splitlines()[-1]))
        print(found, len(refused))
        return found

    stop = threading.Event()
    refused = []

    def traffic() -> None:
        for i in range(1_000_000):
            if stop.is_set():
                return
            try:
                client.completions.create(model=alias, prompt=f"dead {i}")
            except openai.APIStatusError as exc:
                refused.append((exc.status_code, exc.code))

    senders = [threading.Thread(target=traffic) for _ in range(2)]
    for sender in senders:
        sender.start()
    try:
        wait_until(lambda: figures()["state"] == "paused", ROLLBACK_WITHIN_S + 30, "paused")
        # As long again as a rollback would take: still paused, still at its weight.
        paused_at = len(refused)
        wait_until(lambda: len(refused) >= 2 * paused_at + 50, ROLLBACK_WITHIN_S + 30, "more")
        stop.set()
        for sender in senders:
            sender.join()
        counted = wait_until(
            lambda: (f := figures())["no_worker"][dead] >= refused.count(NO_WORKER) and f,
            timeout_s=30,
            what="every refusal counted on the canary",
        )
    finally:
        stop.set()
        for sender in senders:
            sender.join()
        stack.restart_worker(index)
    # Besides the refusals, only requests already on their way when the worker stopped failed.
    assert refused.count(NO_WORKER) > 0.9 * len(refused), Counter(refused)
    assert counted["state"] == "paused"
    assert counted["weight"] == 10  # its ramp (to 40) held
    assert counted["no_worker"][dead] == refused.count(NO_WORKER)
    assert counted["errors"] >= refused.count(NO_WORKER)
    assert counted["no_worker"][names["stable"]] == 0
