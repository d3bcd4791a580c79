"""A GPU worker that hangs or dies, and the supervisor of `make run`, on real processes."""

from __future__ import annotations

import functools
import html
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import redis

from batching.aggregator import HELD_SUFFIX, BatchAggregator
from batching.policy import Policy
from devstack.embedded_redis import free_port
from devstack.stack import ROOT, Stack
from operations.models import POLICY_FIELDS
from tests.support import ADMIN_PASSWORD, ADMIN_USER, unique_queue
from tests.support.admin_client import AdminSession
from tests.support.http import Reply, request, sample
from tests.support.probe_sampler import CONTEXT_TOKENS, stuck_call_key
from tests.support.queue_views import workers_of
from tests.support.waiting import wait_until
from workers.heartbeat import EXIT_DUPLICATE_NAME
from workers.launch import worker_command, worker_environment
from workers.lifecycle import EXIT_HUNG_CALL, EXIT_UNHEALTHY_GPU
from workers.runner import FAILED_CALLS_UNHEALTHY
from workers.samplers.simulated import expected_completion

pytestmark = pytest.mark.integration

PROBE = "tests.support.probe_sampler:ProbeSampler"
CALL_TIMEOUT_MS = 1000
DEADLINE_MS = 3000  # past the call timeout: a hung batch is cut off, not timed out


@dataclass(frozen=True)
class StuckCall:
    pid: int  # of the worker running it
    prompts: list[str]
    started_at: float  # epoch seconds


def stuck_call(client: redis.Redis, queue: str, timeout_s: float = 5) -> StuckCall:
    """The probe's record of the hung or slow call, once it has started."""
    raw = wait_until(lambda: client.get(stuck_call_key(queue)), timeout_s, "the probe's call")
    call = json.loads(raw)
    return StuckCall(int(call["pid"]), list(call["prompts"]), float(call["started_at"]))


def worker_with_pid(stack: Stack, pid: int) -> subprocess.Popen[bytes]:
    (worker,) = [w for w in stack.workers if w.pid == pid]
    return worker


@contextmanager
def monitored(client: redis.Redis) -> Iterator[list[tuple[int, str]]]:
    """Every command Redis runs meanwhile, as (the client's port, the command), as MONITOR
    shows them: a test sees a command that a later one undoes, which polling may miss."""
    seen: list[tuple[int, str]] = []
    monitor = client.monitor().__enter__()

    def watch() -> None:
        try:
            for command in monitor.listen():
                seen.append((int(command["client_port"] or 0), command["command"]))
        except (redis.RedisError, OSError, ValueError):
            return  # the monitor's connection closed

    threading.Thread(target=watch, daemon=True).start()
    try:
        yield seen
    finally:
        monitor.__exit__(None, None, None)


def held_by(pid: int, commands: list[tuple[int, str]], handover_due: str) -> bool:
    """Whether the process `pid` marked a batch held (`BatchAggregator.hold`) among
    `commands`: its ZADD of a held member, on one of its connections."""
    ports = {conn.laddr.port for conn in psutil.Process(pid).net_connections("tcp")}
    return any(
        port in ports
        and command.startswith(f"ZADD {handover_due} ")
        and command.endswith(HELD_SUFFIX)
        for port, command in list(commands)
    )


def live_workers(stack: Stack) -> int:
    client = redis.Redis.from_url(stack.env["REDIS_URL"])
    return workers_of(BatchAggregator(client, stack.env["SAMPLING_QUEUE"])).live_count()


def test_a_hung_call_is_answered_502_at_the_timeout_and_its_worker_leaves(
    start_stack: Callable[..., Stack],
) -> None:
    stack = start_stack(
        "hung",
        env={
            "SAMPLER": PROBE,
            "SAMPLING_CALL_TIMEOUT_MS": str(CALL_TIMEOUT_MS),
            "SAMPLING_DEADLINE_MS": str(DEADLINE_MS),
        },
        gpus=[0, 1],
    )
    client = redis.Redis.from_url(stack.env["REDIS_URL"])
    queue = stack.env["SAMPLING_QUEUE"]
    wait_until(lambda: live_workers(stack) == 2, 30, "both workers live")
    prompts = ["hang: forever"] + [f"alongside {i}" for i in range(5)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(lambda p: (sample(stack.base_url, p), time.time()), prompts))
    first = dict(zip(prompts, replies, strict=True))
    hung = stuck_call(client, queue)
    members = set(hung.prompts)
    assert "hang: forever" in members
    for prompt, (reply, answered_at) in first.items():
        if prompt in members:
            assert reply.status == 502, reply.body
            assert "timed out" in reply.body
            # Cut off at the timeout, not at the deadline.
            assert answered_at - hung.started_at >= CALL_TIMEOUT_MS / 1000
            assert answered_at - hung.started_at <= CALL_TIMEOUT_MS / 1000 + 0.05
        else:  # joined a batch of the other worker
            assert (reply.status, reply.body) == (200, expected_completion(prompt))
    # Out of admission and /readyz at once (its goodbye follows the answers by a round
    # trip), and gone for its supervisor to restart it.
    wait_until(lambda: live_workers(stack) == 1, 0.2, "the hung worker out of admission")
    assert worker_with_pid(stack, hung.pid).wait(timeout=5) == EXIT_HUNG_CALL
    # The other worker serves everything else.
    for i in range(5):
        prompt = f"after the hang {i}"
        assert sample(stack.base_url, prompt).body == expected_completion(prompt)
    assert request(stack.base_url, "/readyz", method="GET").status == 200


def test_a_worker_whose_calls_fail_in_a_row_leaves_admission_and_says_why(
    start_stack: Callable[..., Stack],
) -> None:
    stack = start_stack("unhealthy", env={"SAMPLER": PROBE, "SAMPLING_DEADLINE_MS": "3000"})
    client = redis.Redis.from_url(stack.env["REDIS_URL"])
    queue = stack.env["SAMPLING_QUEUE"]
    aggregator = BatchAggregator(client, queue)
    (worker,) = stack.workers
    # A failure, then a success: not in a row, the worker stays.
    assert sample(stack.base_url, "raise: once").status == 502
    assert sample(stack.base_url, "fine").body == expected_completion("fine")
    for attempt in range(FAILED_CALLS_UNHEALTHY):
        reply = sample(stack.base_url, f"raise: the GPU is gone {attempt}")
        # Each failing batch is answered at once, the last one too: no wait for a deadline.
        assert reply.status == 502, reply.body
    assert worker.wait(timeout=5) == EXIT_UNHEALTHY_GPU
    assert workers_of(aggregator).live_count() == 0
    (info,) = [info for _, info in workers_of(aggregator).infos(0)]
    assert info["state"] == "unhealthy"
    assert stack.log_dir is not None
    log = (stack.log_dir / "worker-cpu.log").read_text()
    assert f"{FAILED_CALLS_UNHEALTHY} sampler calls failed in a row" in log
    assert "probe sampler asked to fail" in log  # the sampler's own reason, in the line
    assert request(stack.base_url, "/readyz", method="GET").status == 503


def test_a_worker_killed_mid_call_loses_only_the_batch_it_was_running(
    start_stack: Callable[..., Stack],
) -> None:
    """Under load, one of two workers is SIGKILLed while it runs a (slow) call and holds the
    next batch, received ahead of its seal: the held batch is handed over to the other
    worker, and only the requests of the running call are lost (504 at their deadline)."""
    stack = start_stack(
        "killed", env={"SAMPLER": PROBE, "SAMPLING_DEADLINE_MS": str(DEADLINE_MS)}, gpus=[0, 1]
    )
    client = redis.Redis.from_url(stack.env["REDIS_URL"])
    queue = stack.env["SAMPLING_QUEUE"]
    keys = BatchAggregator(client, queue).shards[0]
    wait_until(lambda: live_workers(stack) == 2, 30, "both workers live")
    replies: dict[str, Reply] = {}
    stop = threading.Event()

    def load(lane: int) -> None:  # about 10 req/s a lane
        count = 0
        while not stop.is_set():
            prompt = f"load {lane} {count}"
            replies[prompt] = sample(stack.base_url, prompt)
            count += 1

    with ThreadPoolExecutor(16) as pool:
        lanes = [pool.submit(load, lane) for lane in range(10)]
        try:
            wait_until(lambda: len(replies) >= 10, 10, "the load served")
            # The worker asks for its next task near the expected end of its call: it holds a
            # batch it has not sealed when it dies. Its hold is watched as a command (MONITOR)
            # rather than polled for: the batch is due for a hand-over a moment later.
            with monitored(client) as commands:
                slow = pool.submit(sample, stack.base_url, "slow: to be killed")
                running = stuck_call(client, queue)
                # Lanes that start now: the slow batch may hold a request of every lane above,
                # and then no batch would come for its worker to hold.
                lanes += [pool.submit(load, lane) for lane in range(10, 15)]
                wait_until(
                    lambda: held_by(running.pid, commands, keys.handover_due),
                    1,
                    "the slow call's worker holds a batch",
                )
            os.kill(running.pid, signal.SIGKILL)
            # Until the killed call's requests are answered (504, at their deadline).
            others = set(running.prompts) - {"slow: to be killed"}
            wait_until(
                lambda: slow.done() and others <= set(replies),
                DEADLINE_MS / 1000 + 2,
                "the killed call's requests answered",
            )
        finally:  # a failed step ends the load too, rather than leaving the lanes running
            stop.set()
        for lane in lanes:
            lane.result()
        replies["slow: to be killed"] = slow.result()
    lost = {prompt for prompt, reply in replies.items() if reply.status != 200}
    assert lost == set(running.prompts)
    for prompt in lost:
        assert replies[prompt].status == 504
        assert replies[prompt].seconds < DEADLINE_MS / 1000 + 0.1
    for prompt, reply in replies.items():
        if prompt not in lost:
            assert reply.body == expected_completion(prompt)


MakeRun = tuple[subprocess.Popen[bytes], Path, dict[str, str]]


@pytest.fixture
def make_run(redis_url: str, tmp_path: Path) -> Iterator[MakeRun]:
    """What `make run` runs after installing, on the tests' Redis, with the simulated farm."""
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "SAMPLER": "simulated",
        "SAMPLING_QUEUE": unique_queue("supervised"),
        "PORT": str(free_port()),
        "WEB_CONCURRENCY": "1",
        "PYTHONPATH": str(ROOT),
    }
    output = tmp_path / "make-run.log"
    with output.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "devstack.stack"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        yield process, output, env
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)


def test_make_run_starts_a_worker_that_exits_again(make_run: MakeRun) -> None:
    process, output, env = make_run
    base_url = f"http://127.0.0.1:{env['PORT']}"
    client = redis.Redis.from_url(env["REDIS_URL"])
    keys = BatchAggregator(client, env["SAMPLING_QUEUE"]).keys

    def worker_pid() -> int | None:
        names = [name.decode() for name in client.zrange(keys.known_workers, 0, -1)]
        for name in names:
            raw = client.get(keys.worker_info(name))
            if raw and json.loads(raw)["state"] in ("idle", "busy"):
                return int(json.loads(raw)["pid"])
        return None

    wait_until(lambda: b"Ready:" in output.read_bytes(), 90, "make run ready")
    wait_until(worker_pid, 10, "a worker's heartbeat")
    first = worker_pid()
    assert first is not None
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: b"started again" in output.read_bytes(), 15, "the worker started again")
    log = output.read_text()
    assert f"(pid {first}) exited with status -9" in log
    wait_until(lambda: worker_pid() not in (None, first), 60, "the new worker's heartbeat")
    wait_until(lambda: request(base_url, "/readyz", method="GET").status == 200, 30, "ready")
    assert sample(base_url, "E equals ").body == "MC squared"
    assert process.poll() is None  # make run goes on
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0


def policy_fields(queue: str, max_new_tokens: int) -> dict[str, str]:
    """The admin's policy form: the environment's settings but `max_new_tokens`."""
    defaults = Policy()
    fields = {name: getattr(defaults, name) for name in POLICY_FIELDS}
    fields = {name: "" if value is None else str(value) for name, value in fields.items()}
    return {**fields, "queue": queue, "max_new_tokens": str(max_new_tokens)}


def beat_after(info: Callable[[], dict[str, object]], heartbeat_at: object) -> bool:
    return info()["heartbeat_at"] != heartbeat_at


def test_a_policy_the_sampler_refuses_is_not_reported_applied_and_the_admin_says_so(
    start_stack: Callable[..., Stack],
) -> None:
    stack = start_stack("refused-policy", env={"SAMPLER": PROBE})
    queue = stack.env["SAMPLING_QUEUE"]
    aggregator = BatchAggregator(redis.Redis.from_url(stack.env["REDIS_URL"]), queue)
    session = AdminSession(stack.base_url)
    session.login(ADMIN_USER, ADMIN_PASSWORD)

    def info() -> dict[str, object]:
        (found,) = [found for _, found in workers_of(aggregator).infos(0)]
        return found

    # Version 1, which the sampler takes.
    status, url, _ = session.post_form(
        "/admin/sampling/samplingpolicy/add/", policy_fields(queue, 32)
    )
    assert (status, url) == (200, stack.base_url + "/admin/sampling/samplingpolicy/")
    wait_until(lambda: info().get("policy_version") == 1, 5, "the worker on version 1")
    assert 'id="policy-disagreement"' not in session.get("/admin/stats/")[1]

    # Version 2, past the sampler's context: refused, and said so.
    page = session.get("/admin/sampling/samplingpolicy/")[1]
    change = re.search(r"/admin/sampling/samplingpolicy/(\d+)/change/", page)
    assert change
    status, _, _ = session.post_form(change.group(0), policy_fields(queue, CONTEXT_TOKENS))
    assert status == 200
    wait_until(lambda: info().get("policy_refused") == 2, 5, "the worker's refusal")
    assert info()["policy_version"] == 1  # what it runs under, not what it was sent
    assert "context" in str(info()["policy_refused_reason"])
    assert sample(stack.base_url, "still served").body == expected_completion("still served")
    for _ in range(2):  # not its version on a later heartbeat either
        wait_until(functools.partial(beat_after, info, info()["heartbeat_at"]), 3, "a heartbeat")
        assert (info()["policy_version"], info()["policy_refused"]) == (1, 2)

    # The admin's stats page: the worker disagrees with the saved policy, and why.
    status, stats_page = session.get("/admin/stats/")
    assert status == 200
    shown = re.search(r'<div [^>]*id="policy-disagreement">(.*?)</div>', stats_page, re.S)
    assert shown, "the stats page does not say that the worker disagrees"
    text = html.unescape(re.sub(r"<[^>]+>", " ", shown.group(1)))
    assert "not run the saved policy version 2" in " ".join(text.split())
    assert "runs version 1" in text
    assert f"refused version 2 (max new tokens ({CONTEXT_TOKENS})" in text

    # A version the sampler takes ends the disagreement.
    status, _, _ = session.post_form(change.group(0), policy_fields(queue, 16))
    assert status == 200
    wait_until(lambda: info().get("policy_version") == 3, 5, "the worker on version 3")
    assert info()["policy_refused"] is None
    assert 'id="policy-disagreement"' not in session.get("/admin/stats/")[1]


def test_a_second_worker_under_a_live_workers_name_refuses_to_start(
    start_stack: Callable[..., Stack],
) -> None:
    stack = start_stack("duplicate-name", env={"SAMPLER": "simulated"})
    queue = stack.env["SAMPLING_QUEUE"]
    aggregator = BatchAggregator(redis.Redis.from_url(stack.env["REDIS_URL"]), queue)
    wait_until(lambda: workers_of(aggregator).live_count() == 1, 10, "the first worker live")
    ((name, first),) = workers_of(aggregator).infos(0)
    env = {**worker_environment(None, stack.environment()), "PYTHONPATH": str(ROOT)}
    second = subprocess.run(
        worker_command(None, queue), cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    output = second.stdout + second.stderr
    assert second.returncode == EXIT_DUPLICATE_NAME, output[-2000:]
    assert f"worker {name}: another live worker process runs under this name" in output
    assert f"pid {first['pid']}" in output  # which one holds it
    assert "loaded for queue" not in output  # refused before loading a sampler
    # The first worker goes on, alone under its name.
    assert workers_of(aggregator).live_count() == 1
    assert [info["pid"] for _, info in workers_of(aggregator).infos(0)] == [first["pid"]]
    assert sample(stack.base_url, "still one").body == expected_completion("still one")


def test_several_cpu_workers_of_a_stack_count_as_several(
    start_stack: Callable[..., Stack],
) -> None:
    """Four CPU workers on one host: four names, four live workers for admission (they were
    one, all named `{queue}-cpu@host`)."""
    stack = start_stack("four-cpu", env={"SAMPLER": "simulated"}, gpus=[None] * 4)
    aggregator = BatchAggregator(
        redis.Redis.from_url(stack.env["REDIS_URL"]), stack.env["SAMPLING_QUEUE"]
    )

    def four_names() -> bool:
        # Both reads at once: on busy cores one heartbeat may be a moment late for either.
        names = {name for name, _ in workers_of(aggregator).infos(0)}
        return len(names) == 4 and workers_of(aggregator).live_count() == 4

    wait_until(four_names, 30, "four live workers under four names")
    assert all(process.poll() is None for process in stack.workers)
