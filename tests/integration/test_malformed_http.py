"""A raw-socket fuzzer against the real front end: 5,000 generated malformed requests (and
slow, half-finished ones) crash nothing, restart nothing, get no 500 and only the statuses
docs/reliability.md documents, leave memory bounded, and a normal request right after is served."""

from __future__ import annotations

import collections
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from devstack.stack import Stack
from tests.support import malformed
from tests.support.http import sample
from workers.samplers.simulated import expected_completion

pytestmark = pytest.mark.integration

CASES = 5000
SLOW_CASES = 60
SEED = 20261124
# What malformed traffic may get (docs/reliability.md): gunicorn's parser refusals, the
# views' own 4xx, the service's 503/504, and 200 for what was well-formed after all.
DOCUMENTED_STATUSES = {
    200: "a request that was well-formed after all (HTTP/1.0, pipelined, an absolute-form URI)",
    400: "gunicorn: a broken request line, method, header or body; the view: a bad prompt",
    404: "an unknown path",
    405: "a method the path does not take",
    414: "gunicorn: a request line over limit_request_line",
    417: "gunicorn: an Expect other than 100-continue",
    431: "gunicorn: more headers than limit_request_fields, or one over limit_request_field_size",
    501: "gunicorn: a Transfer-Encoding it does not implement",
    503: "overload or an outage: refused fast, with Retry-After",
    504: "no completion within the deadline",
}
RSS_GROWTH_LIMIT_KB = 64 * 1024


@pytest.fixture(scope="module")
def service(start_stack: Callable[..., Stack]) -> Stack:
    return start_stack("fuzz", env={"SAMPLER": "simulated"}, web_processes=2)


def web_processes(master: int) -> set[int]:
    """The gunicorn master's children (its worker processes)."""
    children = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[1]) == master:
            children.add(int(stat.parent.name))
    return children


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def test_5000_malformed_requests_break_nothing(service: Stack) -> None:
    assert service.web is not None
    master = service.web.pid
    workers = web_processes(master)
    assert len(workers) == service.web_processes
    # Warm: each process's memory after its first requests, not its boot's.
    for index in range(20):
        assert sample(service.base_url, f"warm {index}").status == 200
    rss_before = {pid: rss_kb(pid) for pid in workers}

    cases = malformed.cases(CASES, SEED) + malformed.slow_cases(SLOW_CASES, SEED)
    with ThreadPoolExecutor(max_workers=96) as pool:
        outcomes = list(pool.map(lambda case: malformed.send("127.0.0.1", service.port, case, 5.0),
                                 cases))  # fmt: skip

    statuses = collections.Counter(status for outcome in outcomes for status in outcome.statuses)
    by_kind: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for outcome in outcomes:
        by_kind[outcome.case.kind].update(outcome.statuses)
    print("statuses:", dict(statuses))
    print("by kind:", {kind: dict(counts) for kind, counts in by_kind.items()})
    print("connection errors:", collections.Counter(outcome.error for outcome in outcomes))

    undocumented = {
        status: next(o.case.data[:300] for o in outcomes if status in o.statuses)
        for status in statuses
        if status not in DOCUMENTED_STATUSES
    }
    assert not undocumented, f"statuses no one documented (an example each): {undocumented}"
    assert sum(statuses.values()) >= CASES // 2, "most malformed requests got no answer at all"
    assert service.web.poll() is None, "the gunicorn master exited"
    assert web_processes(master) == workers, "a web process died or was restarted"
    for pid, before in rss_before.items():
        growth = rss_kb(pid) - before
        assert growth < RSS_GROWTH_LIMIT_KB, f"web process {pid} grew by {growth} kB"
    reply = sample(service.base_url, "a normal prompt after the storm")
    assert (reply.status, reply.body) == (
        200,
        expected_completion("a normal prompt after the storm"),
    )
    log = Path(service.log_dir or ".", "web.log").read_text(errors="replace")
    assert "Traceback" not in log, log[log.index("Traceback") - 200 :][:3000]
