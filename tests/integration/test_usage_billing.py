"""The billing rule against real processes (gunicorn, a Celery worker, the `openai` client): a
key's `/v1/usage` is the sum of the `usage` of the 200 answers it got, exactly, with `n` from
1 to 5, response-cache hits among them, its web processes and worker with clocks 30 s ahead of
Redis's (Debian's faketime, where installed), and its web processes stopped with SIGTERM
before their periodic flush (their last counts go at exit); then the same in the database's
rows."""

from __future__ import annotations

import os
import signal
import time
import uuid
import warnings
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import psutil
import pytest
from openai import OpenAI
from openai.types import CompletionUsage

from devstack.stack import Stack
from tests.integration.test_usage import in_the_database, usage
from tests.support.keys import create_key, known_everywhere, once_known
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration


# Debian's faketime library (apt-get install faketime): the stack's processes run 30 s ahead.
# Without it the test still checks n, the cache and SIGTERM, and says so; CI requires it.
FAKETIME = next(iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))), None)
SKEW_S = 30


@pytest.fixture(scope="module")
def billed(start_stack: Callable[..., Stack]) -> Stack:
    # The periodic flush an hour apart: only the flush at exit can bring the counts in time.
    env = {"SAMPLER": "simulated", "SAMPLING_REQUIRE_API_KEY": "1",
           "SAMPLING_RESPONSE_CACHE": "1", "SAMPLING_STATS_FLUSH_INTERVAL_S": "3600"}  # fmt: skip
    if FAKETIME is not None:  # the web processes and the worker; Redis keeps the true time
        env |= {"LD_PRELOAD": str(FAKETIME), "FAKETIME": f"+{SKEW_S}s"}
    elif os.environ.get("REQUIRE_FAKETIME"):
        pytest.fail("REQUIRE_FAKETIME is set but faketime is not installed")
    else:
        warnings.warn(
            "faketime not installed (apt-get install faketime): the clocks are not skewed",
            stacklevel=1,
        )
    return start_stack("billed", env=env, web_processes=2)


def charge(charged: list[int], used: CompletionUsage | None) -> int:
    """Add an answer's usage to `charged` (prompt, completion, cached); its cached tokens."""
    assert used is not None
    details = used.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details is not None else 0
    charged[0] += used.prompt_tokens
    charged[1] += used.completion_tokens
    charged[2] += cached
    return cached


def web_pids(stack: Stack) -> list[int]:
    assert stack.web is not None
    return [child.pid for child in psutil.Process(stack.web.pid).children()]


def test_usage_is_the_sum_of_the_answers_usage_with_n_cache_hits_and_a_sigterm(
    billed: Stack,
) -> None:
    name = f"billed {uuid.uuid4().hex[:6]}"
    key = create_key(billed, name)
    wait_until(lambda: known_everywhere(billed, key), 5)
    day = datetime.now(UTC).date().isoformat()
    # Retries as the client does (with its backoff, about 15 s in all): a worker starved on a
    # busy machine can miss its heartbeats for over the 5 s timeout (a 503, seen in CI with
    # another test file's stacks on the same 2 cores); only 200 answers are charged and
    # counted below.
    client = OpenAI(base_url=f"{billed.base_url}/v1", api_key=key, max_retries=5)
    model = billed.env["SAMPLING_QUEUE"]
    charged = [0, 0, 0]  # prompt, completion, cached: the sum of the answers' usage
    hits = 0
    served = 0  # requests answered 200
    for n in range(1, 6):
        prompts = [f"one two {uuid.uuid4().hex[:6]} three" for _ in range(1 + n % 2)]
        # Again until the response cache answers (greedy: temperature 0); the worker stores
        # an answer just after it sends it, so the next request may still be a miss.
        for _ in range(6):
            answer = once_known(partial(client.completions.create, model=model, prompt=prompts,
                                        n=n, max_tokens=1 + n, temperature=0))  # fmt: skip
            served += 1
            cached = charge(charged, answer.usage) > 0
            if FAKETIME is not None:  # the web process's clock is 30 s ahead
                assert answer.created >= time.time() + SKEW_S - 5
            if cached:
                hits += 1
                break
        # Prompt tokens once per prompt, however many choices.
        one = client.completions.create(model=model, prompt=prompts[0], n=1, temperature=0)
        served += 1
        assert one.usage is not None
        assert answer.usage is not None
        assert answer.usage.prompt_tokens == len(prompts) * one.usage.prompt_tokens
        charge(charged, one.usage)
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], n=3
    )
    charge(charged, chat.usage)
    served += 1
    assert hits == 5  # every repeated request came from the cache in the end

    assert usage(billed, key, day)["data"] == []  # nothing flushed yet: an hour apart
    old = web_pids(billed)
    for pid in old:
        psutil.Process(pid).send_signal(signal.SIGTERM)  # gunicorn starts new ones in their place
    wait_until(lambda: not any(psutil.pid_exists(pid) for pid in old), 20)
    wait_until(lambda: len(web_pids(billed)) == 2 and known_everywhere(billed, key), 30)

    [live] = usage(billed, key, day)["data"]
    expected = {
        "prompt_tokens": charged[0],
        "completion_tokens": charged[1],
        "total_tokens": charged[0] + charged[1],
        "prompt_tokens_details": {"cached_tokens": charged[2]},
    }
    assert live["usage"] == expected
    assert live["requests"]["ok"] == served  # a miss repeated until the cache hit counts too

    rows = in_the_database(billed, name)
    assert (rows["prompt"], rows["completion"]) == (charged[0], charged[1])
    [persisted] = usage(billed, key, day)["data"]
    assert persisted["usage"] == expected
