"""API keys against real processes: created by `manage.py createapikey` and in the admin,
published through Redis, checked by gunicorn's processes in memory; 401s in each endpoint's
words; revocation and expiry within 2 s; the raw key in no log."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import openai
import pytest
from openai import OpenAI

from inference_site.lib.stack import ROOT, Stack
from tests.support import ADMIN_PASSWORD, ADMIN_USER
from tests.support.admin_client import AdminSession
from tests.support.http import request, sample
from tests.support.keys import bearer, create_key
from tests.support.waiting import wait_until
from workers.samplers.simulated import expected_completion

pytestmark = pytest.mark.integration

# A change reaches every web process within this long (the promise).
PROPAGATION_S = 2.0


@pytest.fixture(scope="module")
def keyed(start_stack: Callable[..., Stack]) -> Stack:
    return start_stack(
        "keyed", env={"SAMPLER": "simulated", "SAMPLING_REQUIRE_API_KEY": "1"}, web_processes=2
    )


def every_process_answers(stack: Stack, key: str, status: int, tries: int = 8) -> bool:
    """`tries` requests in a row (spread over the web processes) all got `status`."""
    return all(
        sample(stack.base_url, "E equals ", headers=bearer(key)).status == status
        for _ in range(tries)
    )


def test_without_a_key_every_endpoint_says_401_in_its_own_words(keyed: Stack) -> None:
    reply = sample(keyed.base_url, "E equals ")
    assert reply.status == 401
    assert reply.body.count("\n") == 1  # one line
    assert "API key" in reply.body
    assert reply.headers["www-authenticate"].startswith("Bearer")
    for path, body in [
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ]:
        reply = request(keyed.base_url, path, json.dumps(body))
        assert reply.status == 401, path
        assert json.loads(reply.body)["error"]["code"] == "invalid_api_key", path
    reply = request(keyed.base_url, "/v1/models", method="GET")
    assert reply.status == 401
    reply = request(keyed.base_url, "/api/inference", json.dumps({"input": "x"}))
    assert (reply.status, json.loads(reply.body)["error"]) == (401, "UNAUTHORIZED")
    client = OpenAI(base_url=f"{keyed.base_url}/v1", api_key=f"sk-{uuid.uuid4().hex}",
                    max_retries=0)  # fmt: skip
    with pytest.raises(openai.AuthenticationError) as caught:
        client.completions.create(model=keyed.env["SAMPLING_QUEUE"], prompt="x")
    assert "unknown API key" in str(caught.value)
    # Health, readiness and metrics are for operators' probes: no key.
    assert request(keyed.base_url, "/healthz", method="GET").status == 200


def test_a_created_key_works_within_2_s_everywhere(keyed: Stack) -> None:
    key = create_key(keyed, f"client {uuid.uuid4().hex[:6]}", "--tier", "plus")
    created = time.monotonic()
    wait_until(lambda: every_process_answers(keyed, key, 200), PROPAGATION_S + 3)
    assert time.monotonic() - created < PROPAGATION_S
    prompt = f"E equals {uuid.uuid4().hex[:6]} "
    assert sample(keyed.base_url, prompt, headers=bearer(key)).body == expected_completion(prompt)
    client = OpenAI(base_url=f"{keyed.base_url}/v1", api_key=key, max_retries=0)
    completion = client.completions.create(model=keyed.env["SAMPLING_QUEUE"], prompt=prompt)
    assert completion.choices[0].text == expected_completion(prompt)
    assert [m.id for m in client.models.list()] == [keyed.env["SAMPLING_QUEUE"]]
    # The raw key is in no process's log.
    for log in (keyed.log_dir or ROOT).glob("*.log"):
        assert key not in log.read_text(errors="replace"), log.name


def test_revoked_in_the_admin_refused_within_2_s(keyed: Stack) -> None:
    key = create_key(keyed, f"to revoke {uuid.uuid4().hex[:6]}")
    wait_until(lambda: every_process_answers(keyed, key, 200), PROPAGATION_S + 3)
    admin = AdminSession(keyed.base_url)
    admin.login(ADMIN_USER, ADMIN_PASSWORD)
    _, page = admin.get(f"/admin/sampling/apikey/?q={key[:11]}")
    assert key[:11] in page
    [key_id] = re.findall(r"/admin/sampling/apikey/(\d+)/change/", page)
    status, _, _ = admin.post_form(
        "/admin/sampling/apikey/",
        {"action": "revoke", "_selected_action": key_id, "index": "0"},
    )
    assert status == 200
    revoked_at = time.monotonic()
    wait_until(lambda: every_process_answers(keyed, key, 401), PROPAGATION_S + 3)
    assert time.monotonic() - revoked_at < PROPAGATION_S
    reply = sample(keyed.base_url, "E equals ", headers=bearer(key))
    assert "revoked" in reply.body


def test_an_admin_created_key_is_shown_once_and_works(keyed: Stack) -> None:
    admin = AdminSession(keyed.base_url)
    admin.login(ADMIN_USER, ADMIN_PASSWORD)
    name = f"admin made {uuid.uuid4().hex[:6]}"
    _, page = admin.get("/admin/sampling/apikey/add/")
    # The tier select lists the tiers by id.
    options = [chunk.split('"')[0] for chunk in page.split('<option value="')[1:]]
    tier_ids = [option for option in options if option.isdigit()]
    assert tier_ids, "no tier to choose"
    status, _, page = admin.post_form(
        "/admin/sampling/apikey/add/", {"name": name, "tier": tier_ids[-1], "owner": "ops"}
    )
    assert status == 200
    shown = re.findall(r"sk-[A-Za-z0-9_-]{40,}", page)
    assert len(shown) == 1, "the key is shown once, after saving"
    wait_until(lambda: every_process_answers(keyed, shown[0], 200), PROPAGATION_S + 3)
    _, listing = admin.get("/admin/sampling/apikey/")
    assert shown[0] not in listing  # only its prefix
    assert shown[0][:11] in listing


def test_an_expired_key_is_refused(keyed: Stack) -> None:
    expires = (datetime.now(UTC) + timedelta(seconds=3)).isoformat()
    key = create_key(keyed, f"short-lived {uuid.uuid4().hex[:6]}", "--expires", expires)
    wait_until(lambda: every_process_answers(keyed, key, 200), PROPAGATION_S + 3)
    wait_until(lambda: every_process_answers(keyed, key, 401), 6)
    assert "expired" in sample(keyed.base_url, "E equals ", headers=bearer(key)).body


def test_keys_not_required_anonymous_and_unknown_keys_sample_revoked_do_not(
    start_stack: Callable[..., Stack],
) -> None:
    open_stack = start_stack("open", env={"SAMPLER": "simulated"})
    prompt = f"E equals {uuid.uuid4().hex[:6]} "
    assert sample(open_stack.base_url, prompt).body == expected_completion(prompt)
    assert sample(open_stack.base_url, prompt, headers=bearer("EMPTY")).status == 200
    key = create_key(open_stack, f"revoked {uuid.uuid4().hex[:6]}")
    subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "shell", "-c",
         f"from operations.models import ApiKey; k = ApiKey.objects.get(prefix='{key[:11]}'); "
         "k.revoked = True; k.save()"],
        env={**os.environ, **open_stack.environment()}, check=True,
    )  # fmt: skip
    wait_until(lambda: sample(open_stack.base_url, "x", headers=bearer(key)).status == 401, 3)


def test_createapikey_refuses_bad_input(keyed: Stack) -> None:
    def run(*options: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(ROOT / "manage.py"), "createapikey", "x", *options],
            env={**os.environ, **keyed.environment()}, capture_output=True, text=True,
        )  # fmt: skip

    assert "no tier 'gold'" in run("--tier", "gold").stderr
    assert "in the past" in run("--expires", "2001-01-01").stderr
    assert "not a date" in run("--expires", "soon").stderr
    assert run("--rpm", "-1").returncode != 0
