"""Operators' view through real processes: the admin's policy reaching running web processes
and workers, the stats page after traffic (and in headless Chromium), /metrics totals."""

from __future__ import annotations

import contextlib
import html
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from accounts.access import ANONYMOUS_TIER
from batching.aggregator import BatchAggregator
from batching.outcomes import RequestOutcome
from batching.policy import Policy
from devstack.stack import Stack
from operations import dashboard
from tests.support import ADMIN_PASSWORD, ADMIN_USER
from tests.support.admin_client import AdminSession
from tests.support.bursts import burst_until_answered
from tests.support.http import request, sample
from tests.support.queue_views import batch_log_of
from tests.support.waiting import wait_until
from workers.samplers.simulated import expected_completion

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ops(start_stack: Callable[..., Stack], tmp_path_factory: pytest.TempPathFactory) -> Stack:
    """The simulated farm (1 worker) behind two gunicorn processes, with the Prometheus
    multiprocess directory known to the test."""
    metrics_dir = tmp_path_factory.mktemp("prometheus")
    return start_stack(
        "ops",
        env={"SAMPLER": "simulated", "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)},
        web_processes=2,
    )


@pytest.fixture(scope="module")
def admin_session(ops: Stack) -> AdminSession:
    session = AdminSession(ops.base_url)
    session.login(ADMIN_USER, ADMIN_PASSWORD)
    return session


def aggregator_of(stack: Stack) -> BatchAggregator:
    return BatchAggregator(
        redis.Redis.from_url(stack.env["REDIS_URL"]), stack.env["SAMPLING_QUEUE"]
    )


def burst(stack: Stack, count: int, label: str) -> None:
    """`count` simultaneous requests, each checked against its own expected completion."""

    def one(i: int) -> None:
        prompt = f"{label} {i}"
        reply = sample(stack.base_url, prompt)
        assert (reply.status, reply.body) == (200, expected_completion(prompt))

    with ThreadPoolExecutor(count) as pool:
        list(pool.map(one, range(count)))


def policy_form(queue: str, **changes: str) -> dict[str, str]:
    fields = {
        "queue": queue, "max_batch_size": "100", "deadline_ms": "500",
        "max_prompt_bytes": "8192", "max_new_tokens": "32", "temperature": "0", "top_p": "1",
        "stop": "", "fill_target_percent": "90",
        "response_cache_ttl_s": str(Policy().response_cache_ttl_s),  # the form's default
    }  # fmt: skip
    return {**fields, **changes}


def worker_info(stack: Stack, aggregator: BatchAggregator) -> dict[str, object]:
    """The stack's worker's last heartbeat info."""
    key = aggregator.keys.worker_info(f"{stack.env['SAMPLING_QUEUE']}-cpu@{os.uname()[1]}")
    return dict(json.loads(aggregator.client.get(key) or "{}"))


def scrape(stack: Stack) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    reply = request(stack.base_url, "/metrics", method="GET")
    assert reply.status == 200
    assert reply.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(reply.body)
        for s in family.samples
    }


def test_a_bad_policy_is_refused_with_clear_messages(
    ops: Stack, admin_session: AdminSession
) -> None:
    status, _, page = admin_session.post_form(
        "/admin/sampling/samplingpolicy/add/",
        policy_form(ops.env["SAMPLING_QUEUE"], max_batch_size="101", top_p="0"),
    )
    assert status == 200  # the form again, not a redirect
    assert "must be at most 100 prompts" in page
    assert "must be above 0 (1 means no nucleus cut)" in page
    queue = ops.env["SAMPLING_QUEUE"]
    _, log_page = admin_session.get(f"/admin/sampling/policychange/?queue={queue}")
    assert "0 policy changes" in log_page


def test_an_admin_change_of_max_batch_size_is_obeyed_within_2_s(
    ops: Stack, admin_session: AdminSession
) -> None:
    aggregator = aggregator_of(ops)
    burst(ops, 40, "before")
    before = [json.loads(r) for r in batch_log_of(aggregator).recent()]
    assert max(r["size"] for r in before) > 5  # a burst of 40 fills batches beyond 5

    status, url, _ = admin_session.post_form(
        "/admin/sampling/samplingpolicy/add/",
        policy_form(ops.env["SAMPLING_QUEUE"], max_batch_size="5"),
    )
    saved = time.monotonic()
    assert (status, url) == (200, ops.base_url + "/admin/sampling/samplingpolicy/")
    try:
        check_max_batch_size_of_5_is_obeyed(ops, admin_session, aggregator, before, saved)
    finally:  # back to the environment's policy for the other tests of this module
        page = admin_session.get("/admin/sampling/samplingpolicy/")[1]
        change_url = re.search(r"/admin/sampling/samplingpolicy/(\d+)/change/", page)
        assert change_url
        status, url, _ = admin_session.post_form(
            f"/admin/sampling/samplingpolicy/{change_url.group(1)}/delete/", {"post": "yes"}
        )
        assert (status, url) == (200, ops.base_url + "/admin/sampling/samplingpolicy/")
        wait_until(lambda: worker_info(ops, aggregator).get("max_batch_size") != 5, 5,
                   "the worker back on the environment's policy")  # fmt: skip


def check_max_batch_size_of_5_is_obeyed(
    ops: Stack,
    admin_session: AdminSession,
    aggregator: BatchAggregator,
    before: list[dict[str, object]],
    saved: float,
) -> None:
    # The worker: its heartbeat reports the policy it will apply to its next batch.
    wait_until(lambda: worker_info(ops, aggregator).get("max_batch_size") == 5, 3,
               "the worker's heartbeat with the new policy")  # fmt: skip
    worker_seen_s = time.monotonic() - saved
    # heartbeats are 1 s apart: the worker had it at the latest one heartbeat earlier
    assert worker_seen_s < 2.0, worker_seen_s

    # The web processes (both take part in a burst): 2 s after the save, every batch closes
    # at 5. 15 requests: three 100 ms calls of 5 on the one worker fit the 500 ms deadline.
    time.sleep(max(0.0, 2.0 - (time.monotonic() - saved)))  # duration: the bound under test
    known = {r["batch_id"] for r in before}
    # A busy machine can let one past the deadline (a 504): it is sent again, as a client
    # would, and each ends with its own completion.
    sent = burst_until_answered(ops.base_url, [f"after {i}" for i in range(15)])

    def logged_since() -> list[dict[str, Any]] | None:
        """The batches logged since the save, once they hold the burst's 15 requests."""
        records = [json.loads(r) for r in batch_log_of(aggregator).recent()]
        found = [r for r in records if r["batch_id"] not in known]
        return found if sum(int(r["size"]) for r in found) >= 15 else None

    # A worker logs its batch after it answered it: the last record may come a moment later.
    after = wait_until(logged_since, 5, "the burst's batches logged")
    assert after is not None
    assert 15 <= sum(r["size"] for r in after) <= sent
    assert max(r["size"] for r in after) <= 5, [r["size"] for r in after]
    assert {r["policy_version"] for r in after} == {1}

    # The change is in the audit log, with who and what.
    _, log_page = admin_session.get("/admin/sampling/policychange/")
    assert ADMIN_USER in log_page
    assert "max_batch_size: 100 → 5" in log_page


def test_metrics_totals_across_processes_and_workers(ops: Stack) -> None:
    before = scrape(ops)
    aggregator = aggregator_of(ops)
    known = {json.loads(r)["batch_id"] for r in batch_log_of(aggregator).recent()}
    ok, bad = 60, 7
    burst(ops, ok, "metrics")
    for _ in range(bad):
        assert sample(ops.base_url, b"").status == 400

    def with_the_workers_metrics() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """A scrape once the worker has published the burst's batches (with each heartbeat,
        1 s apart), and the web processes their requests."""
        scraped = scrape(ops)
        workers = {json.loads(r)["worker"] for r in batch_log_of(aggregator).recent()}
        batched = sum(
            scraped.get(("sampling_batch_size_sum", (("worker", worker),)), 0.0)
            - before.get(("sampling_batch_size_sum", (("worker", worker),)), 0.0)
            for worker in workers
        )
        return scraped if batched == ok else {}

    after = wait_until(with_the_workers_metrics, 10, "the worker's metrics of the burst")

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("sampling_requests_total", outcome="ok") == ok
    assert delta("sampling_requests_total", outcome="bad_request") == bad
    assert delta("sampling_requests_total", outcome="timeout") == 0
    assert delta("sampling_request_latency_seconds_count") == ok + bad
    # The same requests by tier: without a key, the anonymous tier's.
    assert delta("sampling_tier_requests_total", outcome="ok", tier=ANONYMOUS_TIER) == ok
    assert delta("sampling_tier_request_latency_seconds_count", tier=ANONYMOUS_TIER) == ok + bad
    # Both gunicorn processes wrote their own files: the totals above are their sums.
    files = list(Path(ops.env["PROMETHEUS_MULTIPROC_DIR"]).glob("counter_*.db"))
    assert len(files) >= 2, files

    new_batches = [
        json.loads(r)
        for r in batch_log_of(aggregator).recent()
        if json.loads(r)["batch_id"] not in known
    ]
    worker = new_batches[0]["worker"]
    assert delta("sampling_batch_size_count", worker=worker) == len(new_batches)
    assert delta("sampling_batch_size_sum", worker=worker) == ok
    assert delta("sampling_batches_total", worker=worker) == len(new_batches)
    busy = delta("sampling_worker_busy_seconds_total", worker=worker)
    assert busy == pytest.approx(sum(b["sampler_ms"] for b in new_batches) / 1000, rel=0.01)
    assert ("sampling_expired_items_total", (("worker", worker),)) in after
    assert ("sampling_batch_queue_wait_seconds_count", (("worker", worker),)) in after
    assert ("sampling_sampler_seconds_count", (("worker", worker),)) in after
    # and the HTTP layer, from django-prometheus
    assert delta("django_http_requests_total_by_method_total", method="POST") == ok + bad


# Metrics that get their first sample only from an event this traffic does not make: a
# request shed before Redis, a failing batch. Each is declared in code (checked below), and
# documented.
EVENT_ONLY = {"sampling_shed_requests_total", "sampling_batch_failures_total"}
METRICS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "metrics.md"


def test_the_metrics_reference_lists_what_metrics_exposes(ops: Stack) -> None:
    """Every sampling_* family, and each django_http_* one kept, that /metrics exposes after
    requests of several outcomes and a worker's batches is in the metrics reference, and
    every metric the reference lists is exposed (or is one of EVENT_ONLY)."""
    burst(ops, 5, "reference")
    assert sample(ops.base_url, b"").status == 400

    documented = set(re.findall(r"^\| `(\w+)` \|", METRICS_PAGE.read_text(), flags=re.M))

    def families() -> set[str]:
        reply = request(ops.base_url, "/metrics", method="GET")
        return {
            family.name + ("_total" if family.type == "counter" else "")
            for family in text_string_to_metric_families(reply.body)
            if family.samples
        }

    # The worker's batches come first; the GPU time per request once a web process has
    # flushed the minute's counts: wait for every documented family (the last scrape if not).
    last: dict[str, set[str]] = {}

    def complete() -> bool:
        last["scrape"] = families()
        return documented - EVENT_ONLY <= last["scrape"]

    with contextlib.suppress(AssertionError):  # the assertions below name what is missing
        wait_until(complete, 20, "a scrape with every documented family")
    exposed = {name for name in last["scrape"] if name.startswith(("sampling_", "django_http_"))}
    assert exposed - documented == set()
    assert documented - exposed == EVENT_ONLY
    root = Path(__file__).resolve().parents[2]
    declared = (root / "serving" / "metrics.py").read_text()
    declared += (root / "workers" / "metrics.py").read_text()
    assert {
        name for name in EVENT_ONLY if f'"{name.removesuffix("_total")}"' not in declared
    } == set()


@pytest.fixture(scope="module")
def quiet(start_stack: Callable[..., Stack]) -> Stack:
    """A queue of its own for the stats page: only its test's traffic is in its statistics,
    whatever ran before it."""
    return start_stack("stats", env={"SAMPLER": "simulated"})


def test_stats_page_shows_the_traffic(quiet: Stack, tmp_path: Path) -> None:
    session = AdminSession(quiet.base_url)
    session.login(ADMIN_USER, ADMIN_PASSWORD)
    first, second = 30, 20
    burst(quiet, first, "stats")
    # More traffic in the next 10-second bucket, so that every chart has a line.
    next_bucket = (time.time() // 10 + 1) * 10
    wait_until(lambda: time.time() >= next_bucket + 0.5, 11, "the next 10-second bucket")
    burst(quiet, second, "stats2")
    queue = quiet.env["SAMPLING_QUEUE"]
    client = redis.Redis.from_url(quiet.env["REDIS_URL"])
    wait_until(  # web processes flush their counters once a second
        lambda: (
            dashboard.build(client, queue, Policy()).recent.requests(RequestOutcome.OK)
            == first + second
        ),
        5,
        "the statistics flushed",
    )
    status, page = session.get("/admin/stats/")
    assert status == 200
    # The index links to it.
    assert 'href="/admin/stats/"' in session.get("/admin/")[1]

    # The statistics hold exactly this test's completions, and the page shows what the
    # dashboard computes from them (nothing has left the last minute since: the queue is new).
    board = dashboard.build(client, queue, Policy())
    assert board.recent.requests(RequestOutcome.OK) == first + second
    headline = dict(board.headline)
    shown = page.split("completions/s (ok)</small><b>")[1].split("<")[0]
    assert shown == headline["completions/s (ok)"]
    assert f"{queue}-cpu@" in page  # the worker's row
    assert "simulated" in page
    for series in ("ok", "fill", "p99", "busy"):
        assert f'class="series" data-series="{series}"' in page, series

    # The recommendation: the fewest GPUs for the last minute's busiest 10 s, by hand.
    advice = board.recommendation
    by_hand = math.ceil(
        advice.planned_rps * advice.sampler_ms / 1000
        / (advice.max_batch_size * advice.fill_target_percent / 100)
    )  # fmt: skip
    assert advice.needed_gpus == max(1, by_hand)
    assert html.escape(advice.message) in page
    assert f'class="advice {advice.verdict}"' in page

    check_charts_are_drawn(page, quiet.base_url, tmp_path)


def render_in_chromium(page: str, base_url: str, folder: Path) -> Path:
    """Screenshot the stats page in headless Chromium (Debian's package). The page is saved
    with a <base> pointing at the live server for its CSS; the charts are inline SVG."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        if os.environ.get("REQUIRE_BROWSER"):
            pytest.fail("REQUIRE_BROWSER is set but chromium is not installed")
        pytest.skip("chromium not installed (apt-get install chromium): charts not rendered")
    folder.mkdir(parents=True, exist_ok=True)
    saved = folder / "stats.html"
    saved.write_text(page.replace("<head>", f'<head><base href="{base_url}/">', 1))
    screenshot = folder / "stats.png"
    subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={folder / 'chromium'}", "--hide-scrollbars",
         "--window-size=1400,2200", f"--screenshot={screenshot}", saved.as_uri()],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return screenshot


def drawn_length(page: str, series: str) -> float:
    """The length in pixels of a series' line on the page (every chart, every run)."""
    total = 0.0
    for path in re.findall(rf'data-series="{series}" d="([^"]+)"', page):
        for run in path.split("M")[1:]:
            points = [tuple(map(float, p.split())) for p in run.split("L")]
            total += sum(math.dist(a, b) for a, b in itertools.pairwise(points))
    return total


def reference_length(page: str) -> float:
    lines = re.findall(r'class="reference" x1="([\d.]+)" y1="[\d.]+" x2="([\d.]+)"', page)
    return sum(float(x2) - float(x1) for x1, x2 in lines)


def without_lines(page: str) -> str:
    """The page with every series' line and the reference lines taken out (legends, axes,
    dots and text stay): what the screenshot would hold if no line were drawn."""
    page = re.sub(r'<path class="series"[^>]*/>', "", page)
    return re.sub(r'<line class="reference"[^>]*/>', "", page)


def pixels_of(screenshot: Path, hex_color: str) -> int:
    """Pixels within 12 levels per channel of the colour (anti-aliased edges do not count)."""
    from PIL import Image

    target = tuple(int(hex_color[i : i + 2], 16) for i in (1, 3, 5))
    image = Image.open(screenshot).convert("RGB")
    return sum(
        count
        for count, color in image.getcolors(maxcolors=1 << 20) or []
        if all(abs(a - b) <= 12 for a, b in zip(color, target, strict=True))
    )


def check_charts_are_drawn(page: str, base_url: str, folder: Path) -> None:
    """Each line is on screen: the page's screenshot holds, in the line's colour, at least 40%
    of the line's length (2 px wide) more than the same page without its lines."""
    from operations.charts import PALETTE

    drawn = render_in_chromium(page, base_url, folder / "drawn")
    keep = os.environ.get("STATS_SCREENSHOT")  # to look at it: STATS_SCREENSHOT=/tmp/s.png
    if keep:
        shutil.copy(drawn, keep)
    bare = render_in_chromium(without_lines(page), base_url, folder / "bare")
    expected = {
        "green": drawn_length(page, "ok"),
        "blue": drawn_length(page, "fill"),
        "teal": drawn_length(page, "busy"),
        "red": reference_length(page) * 0.6,  # dashed: 6 px on, 4 off
    }
    for color, length in expected.items():
        assert length > 0, color
        gained = pixels_of(drawn, PALETTE[color]) - pixels_of(bare, PALETTE[color])
        assert gained >= 0.4 * length, (color, gained, length)
