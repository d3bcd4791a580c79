"""An offline job through an alias follows the split, against real processes: a job of many
feed passes lands on the alias's canary, the canary is rolled back mid-job, and the job's
remaining lines run on the stable model from then on (its lines on the canary finish and are
collected first); every line is answered once."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from devstack.stack import Stack
from tests.support import unique_queue
from tests.support.batches import batch_stack, chat_lines, completed, create, ended, keyed_client
from tests.support.batches import records as records_of
from tests.support.manage import manage
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

# Lines of 100 every 50 ms a call: about 10 s of one worker, many feed passes.
LINES = 20_000

STATE_SCRIPT = """
import json
from offline.models import Job, JobLine
job = Job.objects.get(id="{job}")
answered = list(JobLine.objects.filter(job=job, answered=True).values_list("line", flat=True))
print(json.dumps({{"model": job.model, "alias": job.alias, "answered": answered}}))
"""


@pytest.fixture(scope="module")
def names() -> dict[str, str]:
    return {role: unique_queue(role) for role in ("stable", "canary", "split")}


@pytest.fixture(scope="module")
def stack(
    start_stack: Callable[..., Stack],
    tmp_path_factory: pytest.TempPathFactory,
    names: dict[str, str],
) -> Iterator[Stack]:
    models = f"{names['stable']}=simulated,{names['canary']}=simulated"
    stack = batch_stack(
        start_stack, "batch-split", tmp_path_factory.mktemp("split-files"), workers=2,
        SAMPLING_MODELS=models, SAMPLING_QUEUE=names["stable"],
    )  # fmt: skip
    for role in ("stable", "canary"):
        manage(stack, "registermodel", names[role])
    # Every key's jobs on the canary (1,000 to 1 by weight: the key picked is almost surely).
    manage(stack, "setalias", names["split"], f"{names['stable']}=1",
           f"{names['canary']}=1000:canary")  # fmt: skip
    yield stack
    manage(stack, "setalias", names["split"], "--delete")
    for role in ("stable", "canary"):
        manage(stack, "registermodel", names[role], "--delete")


def test_a_job_leaves_a_rolled_back_canary_within_a_feed_pass(
    stack: Stack, names: dict[str, str], tmp_path: Path
) -> None:
    client: OpenAI = keyed_client(stack, "split")
    wait_until(lambda: names["split"] in {m.id for m in client.models.list().data}, 20)
    lines = chat_lines(names["split"], LINES, "split")
    job = create(client, lines)

    def state() -> dict[str, Any]:
        printed = manage(stack, "shell", "-c", STATE_SCRIPT.format(job=job.id))
        return dict(json.loads(printed.strip().splitlines()[-1]))

    def moved_to_stable() -> dict[str, Any] | None:
        found = state()
        return found if found["model"] == names["stable"] else None

    wait_until(
        lambda: completed(client.batches.retrieve(job.id)) >= 1000, 60, "a part on the canary"
    )
    assert state()["model"] == names["canary"]
    manage(stack, "setalias", names["split"], f"{names['stable']}=1", f"{names['canary']}=0")
    rolled_back = time.monotonic()
    moved = wait_until(moved_to_stable, 60, "the job moved to the stable model")
    took_s = time.monotonic() - rolled_back
    assert moved is not None
    done = ended(client, job.id, timeout_s=180)
    assert done.status == "completed", done
    output = records_of(client, done.output_file_id)
    assert sorted(r["custom_id"] for r in output) == sorted(line["custom_id"] for line in lines)
    served = {r["custom_id"]: r["response"]["body"]["model"] for r in output}
    assert set(served.values()) == {names["stable"], names["canary"]}
    # Every line answered after the job moved was sampled on the stable model.
    before = {f"split-{line}" for line in moved["answered"]}
    later = {served[custom_id] for custom_id in served if custom_id not in before}
    assert later == {names["stable"]}
    # The move took the catalog's poll, a feed pass and the canary's calls under way.
    assert took_s < 15, took_s
    assert moved["alias"] == names["split"]
