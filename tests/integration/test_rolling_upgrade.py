"""A rolling upgrade on one Redis and one database, in either order: the workers first, or
the web processes first (as one `kubectl apply` rolls them, the web's faster). The release
before is this repository's last commit whose items carry no deadline, checked out in a git
worktree; its processes run its own code."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from batching.keys import QueueKeys
from batching.registry import WorkerRegistry
from bench.harness.trees import worktree
from devstack.embedded_redis import free_port
from devstack.stack import ROOT, Stack
from tests.support import unique_queue
from tests.support.http import sample
from tests.support.waiting import wait_until
from workers.samplers.simulated import expected_completion

pytestmark = pytest.mark.integration

REQUESTS = 30  # each phase's, sent 10 at a time: a few batches
# The line that gave items their deadline: the release before is its commit's parent.
WIRE_CHANGE = "DEADLINE_MARK = "


def release_before() -> str:
    shallow = subprocess.run(
        ["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    if shallow != "false":
        pytest.skip(
            f"the release before is in the checkout's history (git says shallow: {shallow!r})"
        )
    found = subprocess.run(
        ["git", "log", "--reverse", "--format=%H", "-S", WIRE_CHANGE, "--", "batching/items.py"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert found, "no commit added the deadline to the items"
    return f"{found[0]}^"


@pytest.fixture
def previous_tree() -> Iterator[Path]:
    with worktree(release_before()) as root:
        yield root


def served(*base_urls: str) -> list[tuple[int, bool]]:
    """REQUESTS /sample requests spread over `base_urls`: each one's status and whether its
    answer is its own prompt's."""
    prompts = [f"rolling {unique_queue('p')} {index}" for index in range(REQUESTS)]

    def one(index: int) -> tuple[int, bool]:
        reply = sample(base_urls[index % len(base_urls)], prompts[index])
        return reply.status, reply.body == expected_completion(prompts[index])

    with ThreadPoolExecutor(10) as pool:
        return list(pool.map(one, range(REQUESTS)))


def stack_of(root: Path, env: dict[str, str], gpu: int, log_dir: Path) -> Stack:
    # Names apart (gpu0, gpu1): two releases' workers of one queue live at once.
    return Stack(env=dict(env), gpus=[gpu], web_processes=1, root=root, log_dir=log_dir,
                 port=free_port(), feeds=False)  # fmt: skip


@pytest.mark.parametrize("first", ["workers", "web"])
def test_a_rolling_upgrade_answers_every_request_right(
    first: str, previous_tree: Path, redis_url: str, database_url: str, tmp_path: Path
) -> None:
    queue = unique_queue("rolling")
    env = {"REDIS_URL": redis_url, "DATABASE_URL": database_url, "SAMPLER": "simulated",
           "SAMPLING_QUEUE": queue, "SIMULATED_BATCH_MS": "50",
           # The older worktree has no .secret_key of its own: one key for both releases.
           "DJANGO_SECRET_KEY": "rolling-upgrade-" + uuid.uuid4().hex}  # fmt: skip
    live = WorkerRegistry(redis.Redis.from_url(redis_url), QueueKeys(queue))
    old = stack_of(previous_tree, env, 0, tmp_path / "old")
    new = stack_of(ROOT, env, 1, tmp_path / "new")
    everyone_ok = [(200, True)] * REQUESTS

    def upgrade_workers() -> None:
        new.start_worker(1)
        wait_until(lambda: live.live_count() == 2, 60, "the new worker beside the old one")
        assert served(*bases()) == everyone_ok  # both releases' workers
        old.stop_process(old.workers[0])
        wait_until(lambda: live.live_count() == 1, 30, "the old worker gone")

    def upgrade_web() -> None:
        new.start_web()
        new.wait_ready(120)
        assert served(*bases()) == everyone_ok  # both releases' web processes
        assert old.web is not None
        old.stop_process(old.web)
        old.web = None

    def bases() -> list[str]:
        return [stack.base_url for stack in (old, new) if stack.web is not None]

    try:
        old.start(timeout_s=120)
        assert served(old.base_url) == everyone_ok  # the release before, alone
        for step in (
            (upgrade_workers, upgrade_web) if first == "workers" else (upgrade_web, upgrade_workers)
        ):
            step()
            assert served(*bases()) == everyone_ok
        assert live.live().read_deadlines  # items carry their deadline from now on
        assert served(new.base_url) == everyone_ok  # the upgrade done
    finally:
        new.stop()
        old.stop()
