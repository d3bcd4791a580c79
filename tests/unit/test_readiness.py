"""`/readyz?model=` in a web process: a name the catalog does not hold is a 404 that makes no
model (each model a process serves has pollers of its own, never freed)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import redis
from django.conf import settings
from django.test import RequestFactory

from accounts.access import AccessWatcher
from accounts.ratelimit import RateLimiter
from batching.catalog import CatalogWatcher, base_catalog
from serving import runtime, views
from serving.runtime import WebProcess, listed_models
from serving.shedding import Shedder


@pytest.fixture
def process(redis_url: str) -> Iterator[WebProcess]:
    """This process's web process, its loops not started (no thread outlives the test)."""
    client = redis.Redis.from_url(redis_url)
    made = WebProcess(
        client, CatalogWatcher(client, base_catalog(listed_models())),
        AccessWatcher(client, republish=lambda: None), RateLimiter(client),
        Shedder(settings.WEB_MAX_IN_FLIGHT), settings.SAMPLING_QUEUE,
    )  # fmt: skip
    runtime._web[os.getpid()] = made
    yield made
    del runtime._web[os.getpid()]


def test_an_unknown_model_is_not_made_by_its_readiness_probe(process: WebProcess) -> None:
    name = f"no-such-{uuid.uuid4().hex}"
    reply = views.readyz(RequestFactory().get("/readyz", {"model": name}))
    assert reply.status_code == 404
    assert name in reply.content.decode()
    assert name not in process.models
    assert process.models == {}
