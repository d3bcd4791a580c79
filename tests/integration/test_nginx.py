"""deploy/nginx/ in front of a real stack, run by this machine's nginx (Debian's, which CI
installs): /sample through it with curl, the operators' paths kept to trusted networks, the
body limit, X-Request-Start set by nginx, and 3,000 slow clients held against nginx and
against gunicorn alone."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from django.conf import settings

from batching.policy import BOUNDS
from devstack.stack import Stack
from tests.support import ADMIN_PASSWORD, ADMIN_USER
from tests.support.admin_client import AdminSession
from tests.support.http import request
from tests.support.keys import create_key
from tests.support.nginx_proxy import CONFIG_DIR, Nginx, nginx_binary
from tests.support.slow_fronts import Front, measure, measure_fronts
from tests.support.waiting import wait_until
from workers.samplers.simulated import expected_completion

pytestmark = pytest.mark.integration

# The stack's gunicorn process takes this many connections (the default); the slow clients
# come 1.5 times as many.
WORKER_CONNECTIONS = 2000
SLOW = WORKER_CONNECTIONS * 3 // 2


def _require_nginx() -> None:
    if nginx_binary() is None:
        if os.environ.get("REQUIRE_NGINX"):
            pytest.fail("REQUIRE_NGINX is set but nginx is not installed")
        pytest.skip("nginx not installed (apt-get install nginx): the proxy is not tested")


@pytest.fixture(scope="module")
def stack(start_stack: Callable[..., Stack], tmp_path_factory: pytest.TempPathFactory) -> Stack:
    """One simulated GPU behind one gunicorn process: gunicorn's 2,000 connections."""
    _require_nginx()
    files = tmp_path_factory.mktemp("nginx-files")
    env = {"SAMPLER": "simulated", "WEB_WORKER_CONNECTIONS": str(WORKER_CONNECTIONS),
           "SAMPLING_FILES_DIR": str(files)}  # fmt: skip
    return start_stack("nginx", env=env, web_processes=1)


@pytest.fixture
def nginx(stack: Stack) -> Iterator[Nginx]:
    with Nginx(stack.port) as proxy:
        yield proxy


def curl(*args: str) -> tuple[int, str]:
    """curl's status code and body."""
    if shutil.which("curl") is None:
        pytest.fail("curl is not installed")
    done = subprocess.run(
        ["curl", "-sS", "--max-time", "10", "-o", "-", "-w", "\n%{http_code}", *args],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    body, _, status = done.stdout.rpartition("\n")
    return int(status), body


def test_sample_through_nginx_with_curl(nginx: Nginx) -> None:
    prompt = f"through nginx {time.time_ns()}"
    status, body = curl(f"{nginx.base_url}/sample", "--data-binary", prompt)
    assert (status, body) == (200, expected_completion(prompt))


def test_nginx_sets_the_request_start(stack: Stack, nginx: Nginx) -> None:
    """A request stamped as having arrived a second ago is shed as late when it reaches
    gunicorn with that stamp; through nginx the stamp is nginx's own, so it is served."""
    stale = {"X-Request-Start": f"t={time.time() - 1.0:.3f}"}
    direct = request(stack.base_url, "/sample", "stale stamp", headers=stale)
    assert direct.status == 503, direct
    proxied = request(nginx.base_url, "/sample", "stale stamp", headers=stale)
    assert (proxied.status, proxied.body) == (200, expected_completion("stale stamp"))


def test_operator_paths_only_from_trusted_networks(stack: Stack) -> None:
    # The shipped list trusts loopback: the operators' paths answer.
    with Nginx(stack.port) as open_to_loopback:
        assert request(open_to_loopback.base_url, "/metrics", method="GET").status == 200
        assert request(open_to_loopback.base_url, "/admin/login/", method="GET").status == 200
    # Trusting only a network this client is not on: 403 for them, the API still served.
    with Nginx(stack.port, trusted=["192.0.2.0/24"]) as closed:
        for path in ("/metrics", "/admin/", "/admin/login/", "/admin"):
            assert request(closed.base_url, path, method="GET").status == 403, path
        assert request(closed.base_url, "/healthz", method="GET").status == 200
        assert request(closed.base_url, "/sample", "still served").status == 200


def test_behind_a_trusted_balancer_the_client_is_the_forwarded_one(stack: Stack) -> None:
    """A balancer (this client, on loopback) listed in balancers.conf: the client is the
    address it forwards, so one from outside the trusted networks gets 403 even though the
    connection comes from loopback. Without the listing, a client's X-Forwarded-For proves
    nothing: the connection's own address counts."""
    outsider = {"X-Forwarded-For": "192.0.2.9"}
    with Nginx(stack.port, balancers=["127.0.0.1"]) as behind:
        assert request(behind.base_url, "/metrics", method="GET", headers=outsider).status == 403
        insider = {"X-Forwarded-For": "10.1.2.3"}
        assert request(behind.base_url, "/metrics", method="GET", headers=insider).status == 200
    with Nginx(stack.port) as direct:
        assert request(direct.base_url, "/metrics", method="GET", headers=outsider).status == 200


def test_admin_login_through_nginx(stack: Stack, nginx: Nginx) -> None:
    """As a browser posts the login form: with an Origin that carries the port, which Django
    compares with the Host nginx passes on (a CSRF 403 if nginx dropped the port)."""
    session = AdminSession(nginx.base_url, headers={"Origin": nginx.base_url})
    session.login(ADMIN_USER, ADMIN_PASSWORD)


def test_body_limit_is_what_the_service_reads(nginx: Nginx) -> None:
    match = re.search(r"client_max_body_size\s+(\d+)k;", (CONFIG_DIR / "nginx.conf").read_text())
    assert match, "client_max_body_size not set in KiB"
    limit = int(match.group(1)) * 1024
    assert limit == settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    assert limit > BOUNDS["max_prompt_bytes"][1]  # the largest prompt a policy allows fits
    # Over it, nginx refuses before gunicorn sees a byte; at it, nginx passes it on and the
    # service answers with its own reason (the queue's prompt limit). The service's answers
    # carry its security headers (inference_site.direct), nginx's own do not.
    too_large = request(nginx.base_url, "/sample", b"x" * (limit + 1))
    assert too_large.status == 413
    assert "x-frame-options" not in too_large.headers
    at_limit = request(nginx.base_url, "/sample", b"x" * limit)
    assert 400 <= at_limit.status < 500, at_limit
    assert "x-frame-options" in at_limit.headers, at_limit


def test_a_batch_file_over_the_body_limit_passes_on_v1_files_only(
    stack: Stack, nginx: Nginx, tmp_path: Path
) -> None:
    key = create_key(stack, "nginx-files")
    auth = f"Authorization: Bearer {key}"
    wait_until(lambda: curl("-H", auth, f"{nginx.base_url}/v1/files")[0] == 200,
               what="the key known")  # fmt: skip
    # A file several times the body limit of every other path.
    big = tmp_path / "big.jsonl"
    line = json.dumps({"custom_id": "x" * 40, "method": "POST", "url": "/v1/completions",
                       "body": {"model": "m", "prompt": "p" * 900}}) + "\n"  # fmt: skip
    big.write_text(line * (4 * settings.DATA_UPLOAD_MAX_MEMORY_SIZE // len(line)))
    status, body = curl("-H", auth, "-F", "purpose=batch", "-F", f"file=@{big}",
                        f"{nginx.base_url}/v1/files")  # fmt: skip
    assert status == 200, body
    assert json.loads(body)["bytes"] == big.stat().st_size
    status, _ = curl("-H", auth, "-H", "Content-Type: application/json", "--data-binary",
                     f"@{big}", f"{nginx.base_url}/v1/completions")  # fmt: skip
    assert status == 413
    # Over the file limit (and the form around it), nginx refuses before the service reads
    # a byte of it.
    huge = tmp_path / "huge.jsonl"
    with huge.open("wb") as handle:
        handle.truncate(settings.SAMPLING_BATCH_FILE_MAX_BYTES + 2 * 1024 * 1024)
    status, _ = curl("-H", auth, "-H", "Expect: 100-continue", "-F", "purpose=batch", "-F",
                     f"file=@{huge}", f"{nginx.base_url}/v1/files")  # fmt: skip
    assert status == 413


# A client's measure of a deadline: its own connect and read on the shared cores.
CLIENT_SLACK_MS = 100
# Runs of the slow clients' measure at most, the first that keeps the promise judged.
MEASURES = 2


def kept_the_promise(quiet: dict[str, object], slowed: dict[str, object]) -> bool:
    """Every request answered, and the slowed run's p99 within the deadline as a client measures
    it: a burst of another test's work on the shared cores spoils a run on either count."""
    answered = quiet["unanswered"] == slowed["unanswered"] == 0
    p99 = float(str(slowed["p99"]))
    return answered and p99 <= settings.SAMPLING_DEADLINE_MS + CLIENT_SLACK_MS


def test_slow_clients_cost_nginx_not_gunicorn(stack: Stack, nginx: Nginx) -> None:
    """3,000 slow connections: through nginx every /sample request is still answered (a 200,
    or a fast 503 or a 504 where the machine cannot carry the load in time) within its
    deadline, and gunicorn holds only the requests in flight; straight to gunicorn they take
    its 2,000 connections, and requests fail or wait far past their deadline. How much the p99
    moves is a figure for the slow-client benchmark (docs/benchmarks/slowloris.md), not for one
    10 s run on 2 shared cores, where the slow clients' own events compete for the
    CPU. The stack serves a second of the load in full before each measure: processes that
    earlier tests left exiting on the same cores, or the last measure's slow clients still
    closing, are not what this test measures."""
    for _ in range(MEASURES):  # another test's burst on the shared cores spoils a run
        # gunicorn drains the last measure's 3,000 slow clients before the next one starts.
        wait_until(
            lambda: measure(nginx.port, 1.0)["unanswered"] == 0,
            60,
            "every request of a second's load answered",
        )
        rows = measure_fronts(
            [Front("nginx", nginx.port), Front("gunicorn", stack.port)],
            slow=3000,
            seconds=10,
            gunicorn_port=stack.port,
        )
        for row in rows:
            print(row)
        by = {(row["front"], row["slow"]): row for row in rows}
        if kept_the_promise(by["nginx", 0], by["nginx", SLOW]):
            break
    assert all(row["wrong"] == 0 for row in rows)
    quiet, slowed = by["nginx", 0], by["nginx", SLOW]
    assert int(str(slowed["held"])) >= SLOW * 0.98  # (nearly) all of them open at once
    # The service's promise holds for the others: each answered (a 200, or a 503 or 504 where
    # this machine, busy with the slow clients' events and maybe other work, cannot carry the
    # load in time), and within its deadline, as a client measures it.
    assert quiet["unanswered"] == slowed["unanswered"] == 0, (quiet, slowed)
    assert float(str(slowed["ok"])) > 0, slowed
    assert float(str(slowed["p99"])) <= settings.SAMPLING_DEADLINE_MS + CLIENT_SLACK_MS, slowed
    # Through nginx, gunicorn holds only the requests in flight over nginx's pool.
    assert int(str(slowed["gunicorn connections"])) < 200, slowed
    alone, exhausted = by["gunicorn", 0], by["gunicorn", SLOW]
    # Straight to it, the slow clients take (nearly) every one of its connections: the count
    # reads established connections and the accept queue in two passes over /proc/net/tcp, and
    # connections gunicorn drops (the slow clients open them again) can fall in between.
    assert int(str(exhausted["gunicorn connections"])) >= WORKER_CONNECTIONS * 0.98, exhausted
    assert alone["unanswered"] == 0, alone
    # Past gunicorn's 2,000 connections the rest wait in the kernel's backlog: some requests
    # are not answered 200, shed with a 503 for the deadline they spent waiting there or given
    # up by the client. (Not the p99: those 503s are fast, and a run's share of them varies.)
    assert float(str(exhausted["ok"])) < 0.99, exhausted
