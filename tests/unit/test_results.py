"""The shared result listener behind `app.AsyncResult(id).get(timeout=...)`, on a real Redis.

The test plays the worker's part by storing results with the same backend class, which
writes the key and publishes on its channel exactly as a worker does.
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from celery import Celery, states
from celery.exceptions import TimeoutError as CeleryTimeoutError

from batching.keys import results_channel
from batching.result_store import queue_result
from batching.results import SharedListenerRedisBackend, listener_for
from tests.support.waiting import wait_until


@pytest.fixture
def app(redis_url: str) -> Celery:
    app = Celery("results-test", set_as_current=False)
    app.conf.update(
        result_backend=f"batching.results:SharedListenerRedisBackend+{redis_url}",
        broker_url=redis_url,
    )
    return app


def backend_of(app: Celery) -> SharedListenerRedisBackend:
    backend = app.backend
    assert isinstance(backend, SharedListenerRedisBackend)
    return backend


def subscribers(client: redis.Redis, channel: str) -> int:
    """The connections subscribed to `channel`, as the server counts them."""
    ((_, count),) = client.pubsub_numsub(channel)
    return int(count)


def store(app: Celery, task_id: str, value: object, state: str = states.SUCCESS) -> None:
    app.backend.store_result(task_id, value, state)


def test_backend_is_the_shared_one_per_process(app: Celery) -> None:
    seen: list[object] = []
    threads = [threading.Thread(target=lambda: seen.append(app.backend)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert isinstance(app.backend, SharedListenerRedisBackend)
    assert all(backend is app.backend for backend in seen)


def test_every_local_waiter_of_a_batch_is_woken(app: Celery) -> None:
    task_id = uuid.uuid4().hex
    waiters = 100

    def wait(index: int) -> tuple[object, float]:
        result = app.AsyncResult(task_id).get(timeout=5)
        return result[index], time.monotonic()

    with ThreadPoolExecutor(waiters) as pool:
        futures = [pool.submit(wait, i) for i in range(waiters)]
        listener = backend_of(app).listener
        wait_until(lambda: listener.waiting_on(task_id) == waiters, 5, "every waiter registered")
        published = time.monotonic()
        store(app, task_id, [f"answer {i}" for i in range(waiters)])
        outcomes = [f.result() for f in futures]
    assert [value for value, _ in outcomes] == [f"answer {i}" for i in range(waiters)]
    slowest = max(woken for _, woken in outcomes) - published
    assert slowest < 0.5, slowest
    assert backend_of(app).listener.pending_count() == 0  # everyone unregistered


def test_result_stored_before_the_wait_is_found(app: Celery) -> None:
    task_id = uuid.uuid4().hex
    store(app, task_id, ["early"])
    started = time.monotonic()
    assert app.AsyncResult(task_id).get(timeout=2) == ["early"]
    assert time.monotonic() - started < 0.5


def test_timeout_fires_at_the_deadline(app: Celery) -> None:
    errors = []
    for timeout in (0.05, 0.2, 0.5):
        started = time.monotonic()
        with pytest.raises(CeleryTimeoutError):
            app.AsyncResult(uuid.uuid4().hex).get(timeout=timeout)
        errors.append(time.monotonic() - started - timeout)
    # Never early; late by no more than the service's own allowance past a deadline (50 ms):
    # a 20 ms bound failed once on these 2 cores while other tests' processes were busy.
    assert all(0 <= error < 0.05 for error in errors), errors


def test_failure_state_propagates_as_an_exception(app: Celery) -> None:
    task_id = uuid.uuid4().hex
    store(app, task_id, RuntimeError("sampler exploded"), states.FAILURE)
    with pytest.raises(RuntimeError, match="sampler exploded"):
        app.AsyncResult(task_id).get(timeout=2)


def test_listener_survives_a_dropped_connection(app: Celery, redis_url: str) -> None:
    listener = listener_for(backend_of(app))
    task_id = uuid.uuid4().hex
    # Make sure the listener is connected, then kill its connection from the server side.
    store(app, "warm-" + task_id, [1])
    assert app.AsyncResult("warm-" + task_id).get(timeout=2) == [1]
    client = listener.client
    channel = results_channel(task_id)
    subscribed = subscribers(client, channel)
    killed = 0
    for entry in client.client_list():
        if entry.get("cmd") in ("subscribe", "unsubscribe", "ping"):
            killed += client.client_kill_filter(_id=entry["id"])
    assert killed >= 1
    result: list[object] = []
    waiter = threading.Thread(target=lambda: result.append(app.AsyncResult(task_id).get(timeout=5)))
    waiter.start()
    wait_until(  # the listeners reconnect and subscribe their channels again
        lambda: listener.waiting_on(task_id) == 1 and subscribers(client, channel) >= subscribed,
        5,
        "the listener subscribed again",
    )
    store(app, task_id, ["after reconnect"])
    waiter.join(timeout=6)
    assert result == [["after reconnect"]]


def test_a_success_queued_on_a_pipeline_is_stored_as_celery_stores_one(
    app: Celery, redis_url: str
) -> None:
    """A worker publishes a batch's answers in a pipeline of its own (queue_result): the
    waiters get them as from store_result, and the stored meta is Celery's own."""
    answers = [["ok", "first"], ["expired", "deadline could not be met"]]
    by_celery, by_pipeline = uuid.uuid4().hex, uuid.uuid4().hex
    backend = backend_of(app)
    client = redis.Redis.from_url(redis_url)
    channel = results_channel(by_pipeline)
    before = subscribers(client, channel)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(lambda: app.AsyncResult(by_pipeline).get(timeout=5))
        wait_until(  # subscribed: the PUBLISH is what wakes it
            lambda: (
                backend.listener.waiting_on(by_pipeline) == 1
                and subscribers(client, channel) > before
            ),
            5,
            "the waiter subscribed",
        )
        store(app, by_celery, answers)
        with redis.Redis.from_url(redis_url).pipeline(transaction=False) as pipe:
            queue_result(pipe, backend, by_pipeline, answers)
            pipe.execute()
        assert waiting.result() == answers
    celery_meta = backend.get_task_meta(by_celery)
    pipeline_meta = backend.get_task_meta(by_pipeline)
    for meta in (celery_meta, pipeline_meta):
        meta.pop("task_id")
        meta.pop("date_done")
    assert pipeline_meta == celery_meta
    expiry = client.ttl(backend.get_key_for_task(by_pipeline))
    assert 0 < expiry <= client.ttl(backend.get_key_for_task(by_celery)) + 1
