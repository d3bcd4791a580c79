"""An alias's target in a web process's memory: usable while it has a live worker and is not
cooling down after failing requests in a row (serving.runtime.ServedModel)."""

from __future__ import annotations

import time
import uuid

import redis

from accounts.ratelimit import RateLimiter
from serving.runtime import COOLDOWN_AFTER_FAILURES, COOLDOWN_S, make_model


def test_failures_in_a_row_cool_a_target_down_and_an_answer_between_them_does_not(
    redis_url: str,
) -> None:
    client = redis.Redis.from_url(redis_url)
    model = make_model(client, f"t-cool-{uuid.uuid4().hex[:8]}", RateLimiter(client))
    model.live_workers = 1
    for _ in range(COOLDOWN_AFTER_FAILURES - 1):
        model.ended(failed=True)
    model.ended(failed=False)  # an answer: the count starts again
    for _ in range(COOLDOWN_AFTER_FAILURES - 1):
        model.ended(failed=True)
    assert model.usable()
    before = time.monotonic()
    model.ended(failed=True)
    assert not model.usable()
    assert before + COOLDOWN_S <= model.cool_until <= time.monotonic() + COOLDOWN_S
    model.cool_until = 0.0  # the cooldown over
    assert model.usable()
    model.live_workers = 0  # no live worker at the last read
    assert not model.usable()
