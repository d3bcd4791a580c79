"""What storing a batch's answers takes, as Celery's Redis backend stores a result and as
the web processes' result listeners (batching.results) hear of it: the key, in Celery's meta
and encoding, and a message on the batch's shard's results channel. Used by the workers (a
batch's answers), the web processes (an abandoned batch's) and the result backend."""

from __future__ import annotations

from typing import Any

import redis
from celery import states
from celery.backends.redis import RedisBackend
from redis.cluster import ClusterPipeline

from batching.keys import results_channel


def key_prefix(backend: RedisBackend) -> str:
    """What the backend puts before a task id in its result key: celery-task-meta-."""
    key: str | bytes = backend.get_key_for_task("x")  # bytes at run time, str in the stubs
    return (key.decode() if isinstance(key, bytes) else key)[:-1]


def publish_message(task_id: str, value: bytes | str) -> bytes:
    """What is published: the task id, a space, then the stored meta."""
    raw = value if isinstance(value, bytes) else value.encode()
    return task_id.encode() + b" " + raw


def queue_result(
    pipe: redis.client.Pipeline,
    backend: RedisBackend,
    task_id: str,
    result: Any,
    state: str = states.SUCCESS,
    expires_s: float | None = None,
) -> None:
    """Queue on `pipe` what storing a task's result takes: the SET of its key (with
    `expires_s`, by default the results' expiry), in Celery's own meta and encoding, so that
    `AsyncResult(task_id).get()` reads it as any stored result, and its PUBLISH on the
    shard's results channel.

    Sent in a pipeline of the caller's (a worker sends a batch's answers with its record), and
    without the GET by which `store_result` first checks for a stored success: a sealed batch
    is answered once.
    """
    encoded = backend.encode_result(result, state)
    # Celery's own meta (status, result, traceback, children, date_done, and the extended
    # fields when result_extended is on): the one private name used here, as stable as the
    # format it builds.
    meta = backend._get_result_meta(  # type: ignore[attr-defined]
        result=encoded, state=state, traceback=None, request=None
    )
    meta["task_id"] = task_id
    queue_store(pipe, backend, task_id, backend.encode(meta), expires_s)


def queue_store(
    pipe: redis.client.Pipeline,
    backend: RedisBackend,
    task_id: str,
    value: bytes | str,
    expires: float | None = None,
) -> None:
    key = backend.get_key_for_task(task_id)
    expires = expires if expires is not None else backend.expires  # type: ignore[attr-defined]
    if expires:
        pipe.set(key, value, px=max(1, int(expires * 1000)))
    else:
        pipe.set(key, value)
    channel, message = results_channel(task_id), publish_message(task_id, value)
    if isinstance(pipe, ClusterPipeline):
        pipe.execute_command("SPUBLISH", channel, message)
    else:
        pipe.publish(channel, message)
