"""Usage per API key against real processes: what a key sent, counted by the web processes
(requests by outcome) and the worker (tokens), read back by the key with `GET /v1/usage`
while it is in Redis and again once housekeeping has written it to the database's rows."""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from openai import OpenAI

from batching.outcomes import RequestOutcome
from devstack.stack import ROOT, Stack
from serving.schemas import UsageReport
from tests.support import ADMIN_PASSWORD, ADMIN_USER
from tests.support.admin_client import AdminSession
from tests.support.http import request, sample
from tests.support.keys import bearer, create_key, known_everywhere
from tests.support.waiting import wait_until
from workers.samplers.simulated import SimulatedSampler, expected_completion

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def metered(start_stack: Callable[..., Stack]) -> Stack:
    return start_stack(
        "metered", env={"SAMPLER": "simulated", "SAMPLING_REQUIRE_API_KEY": "1"}, web_processes=2
    )


def table_rows(page: str, table_id: str) -> dict[str, list[str]]:
    """A table of the page, as {first cell's text: the other cells' texts}."""
    table = page.split(f'id="{table_id}"', 1)[1].split("</table>", 1)[0]
    rows = {}
    for row in re.findall(r"<tr>(.*?)</tr>", table, flags=re.S):
        cells = [html.unescape(re.sub(r"<[^>]+>", "", cell)).strip()
                 for cell in re.findall(r"<td>(.*?)</td>", row, flags=re.S)]  # fmt: skip
        if cells:
            rows[cells[0].split(" (")[0]] = cells[1:]
    return rows


def usage(stack: Stack, key: str, day: str | None = None) -> dict[str, Any]:
    path = "/v1/usage" + (f"?date={day}" if day is not None else "")
    reply = request(stack.base_url, path, method="GET", headers=bearer(key))
    assert reply.status == 200, reply.body
    UsageReport.model_validate_json(reply.body)  # the answer is what the OpenAPI document says
    return dict(json.loads(reply.body))


def in_the_database(stack: Stack, key_name: str) -> dict[str, Any]:
    """Housekeeping run as a web process runs it, with a clock two minutes ahead (every minute
    so far has ended), then the key's rows summed: the operator's view of them."""
    script = f"""
import json, time
from operations import housekeeping
from operations.models import UsageMinute
from serving.redis_client import redis_client
housekeeping.persist_minutes(redis_client(), {stack.env["SAMPLING_QUEUE"]!r}, time.time() + 120)
rows = UsageMinute.objects.filter(key__name={key_name!r})
requests = {{}}
for row in rows:
    for outcome, count in row.requests.items():
        requests[outcome] = requests.get(outcome, 0) + count
print(json.dumps({{"requests": requests, "tiers": sorted({{row.tier for row in rows}}),
                  "prompt": sum(r.prompt_tokens for r in rows),
                  "completion": sum(r.completion_tokens for r in rows)}}))
"""
    done = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "shell", "-c", script],
        env={**os.environ, **stack.environment()}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_usage_is_what_the_key_sent_live_and_in_the_rows(metered: Stack) -> None:
    name = f"metered {uuid.uuid4().hex[:6]}"
    key = create_key(metered, name, "--tier", "plus")
    bystander = create_key(metered, f"bystander {uuid.uuid4().hex[:6]}")
    wait_until(lambda: known_everywhere(metered, key) and known_everywhere(metered, bystander), 5)
    day = datetime.now(UTC).date().isoformat()
    assert usage(metered, key, day)["data"] == []  # a new key has used nothing
    sampler = SimulatedSampler()

    prompts = [f"E equals {uuid.uuid4().hex[:8]} " for _ in range(4)]
    for prompt in prompts:
        assert sample(metered.base_url, prompt, headers=bearer(key)).status == 200
    prompt_tokens = sum(sampler.count_tokens(p) for p in prompts)
    completion_tokens = sum(sampler.count_tokens(expected_completion(p)) for p in prompts)
    client = OpenAI(base_url=f"{metered.base_url}/v1", api_key=key, max_retries=0)
    for n in range(3):
        completion = client.completions.create(
            model=metered.env["SAMPLING_QUEUE"], prompt=f"one two three {n}", max_tokens=2 + n
        )
        assert completion.usage is not None
        prompt_tokens += completion.usage.prompt_tokens
        completion_tokens += completion.usage.completion_tokens
    bad = request(metered.base_url, "/v1/completions", json.dumps({"prompt": "x", "n": 0}),
                  headers=bearer(key))  # fmt: skip
    assert bad.status == 400
    sample(metered.base_url, "not mine", headers=bearer(bystander))

    sent: dict[str, int] = {RequestOutcome.OK: len(prompts) + 3, RequestOutcome.BAD_REQUEST: 1}

    seen: list[object] = []

    def counted() -> bool:  # web processes flush their counts once a second
        data = usage(metered, key, day)["data"]
        seen[:] = [data]
        return bool(data) and data[0]["requests"]["total"] == sum(sent.values())

    # Within 10 s: a second per flush, and CI's cores are shared with the suite's other stacks.
    try:
        wait_until(counted, 10)
    except AssertionError as failed:
        raise AssertionError(f"{failed}; sent {sent}, /v1/usage said {seen}") from None
    [live] = usage(metered, key, day)["data"]
    assert live["model"] == metered.env["SAMPLING_QUEUE"]
    assert live["requests"] == {"total": sum(sent.values()), **sent}
    assert live["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    }

    rows = in_the_database(metered, name)
    assert rows["requests"] == sent
    assert (rows["prompt"], rows["completion"]) == (prompt_tokens, completion_tokens)
    assert rows["tiers"] == ["plus"]
    # The admin sums the rows per key and per tier.
    admin = AdminSession(metered.base_url)
    admin.login(ADMIN_USER, ADMIN_PASSWORD)
    _, page = admin.get("/admin/sampling/usageminute/?tier=plus")
    by_key = table_rows(page, "usage-by-key")
    assert by_key[name][:4] == [
        str(sum(sent.values())), str(sent[RequestOutcome.OK]), str(prompt_tokens),
        str(completion_tokens),
    ]  # fmt: skip
    assert "plus" in table_rows(page, "usage-by-tier")
    # Read back from the rows now (the minutes are persisted): the same figures, once.
    [persisted] = usage(metered, key, day)["data"]
    assert persisted == live
    # Another day is empty; a malformed date is a 400 naming the parameter.
    assert usage(metered, key, "2001-01-01")["data"] == []
    reply = request(metered.base_url, "/v1/usage?date=yesterday", method="GET",
                    headers=bearer(key))  # fmt: skip
    assert reply.status == 400
    assert json.loads(reply.body)["error"]["param"] == "date"
    # Any date is a 200 or a 400, never a 500: the last one a day after it can be counted to
    # is out of range, the first one is in.
    for day, status in (("9999-12-31", 400), ("9999-12-30", 200), ("0001-01-01", 200)):
        reply = request(metered.base_url, f"/v1/usage?date={day}", method="GET",
                        headers=bearer(key))  # fmt: skip
        assert reply.status == status, (day, reply.body)


def test_usage_needs_a_key(metered: Stack) -> None:
    reply = request(metered.base_url, "/v1/usage", method="GET")
    assert reply.status == 401
    assert json.loads(reply.body)["error"]["code"] == "invalid_api_key"
