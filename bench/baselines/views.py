"""The baselines' views: the same request handling as the product's view (POST body in,
plain text out, 504 at the deadline), and the same result listener to wait with, so that
what differs is how requests reach the sampler."""

from __future__ import annotations

import threading
import time
from typing import Any

from celery.exceptions import TimeoutError as CeleryTimeoutError
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt

from bench.baselines import settings as bench_settings
from bench.baselines import tasks
from serving.broker import app as celery_app
from serving.redis_client import redis_client

PLAIN_SET_KEY = "bench:plain-set"


def _text(status: int, body: str) -> HttpResponse:
    return HttpResponse(body, status=status, content_type="text/plain; charset=utf-8")


def _prompt(request: HttpRequest) -> str | HttpResponse:
    if request.method != "POST" or not request.body:
        return _text(400, "POST the prompt as the request body\n")
    return request.body.decode("utf-8", "replace")


def _timeout() -> HttpResponse:
    return _text(504, f"no completion within the {settings.SAMPLING_DEADLINE_MS} ms deadline\n")


def _wait(task_id: str, deadline: float) -> HttpResponse:
    try:
        completion = celery_app.AsyncResult(task_id).get(
            timeout=max(0.0, deadline - time.monotonic())
        )
    except CeleryTimeoutError:
        return _timeout()
    return _text(200, completion)


def _via_task(request: HttpRequest, task: Any) -> HttpResponse:
    """Send the prompt as one message of `task` and wait for that message's result."""
    deadline = time.monotonic() + settings.SAMPLING_DEADLINE_MS / 1000
    prompt = _prompt(request)
    if isinstance(prompt, HttpResponse):
        return prompt
    return _wait(task.delay(prompt).id, deadline)


@csrf_exempt
def per_request(request: HttpRequest) -> HttpResponse:
    return _via_task(request, tasks.sample_one)


@csrf_exempt
def celery_batches(request: HttpRequest) -> HttpResponse:
    return _via_task(request, tasks.sample_batched)


class _Waiter:
    __slots__ = ("completion", "done", "prompt")

    def __init__(self, prompt: str) -> None:
        self.prompt = prompt
        self.done = threading.Event()
        self.completion: str | None = None


class TimerBatcher:
    """This process's buffer: flushed `interval_s` after its first request arrived or at
    `max_size` requests, whichever comes first, as one Celery task; a thread (a greenlet
    under gevent) per flush waits for its result and wakes the batch's requests."""

    def __init__(self, interval_s: float, max_size: int, deadline_s: float) -> None:
        self.interval_s, self.max_size, self.deadline_s = interval_s, max_size, deadline_s
        self.lock = threading.Lock()
        self.buffer: list[_Waiter] = []
        self.generation = 0  # which buffer a timer was started for

    def submit(self, prompt: str) -> _Waiter:
        waiter = _Waiter(prompt)
        with self.lock:
            self.buffer.append(waiter)
            if len(self.buffer) == 1:
                timer = threading.Thread(target=self._timer, args=(self.generation,))
                timer.daemon = True
                timer.start()
            full = len(self.buffer) >= self.max_size
        if full:
            self.flush()
        return waiter

    def _timer(self, generation: int) -> None:
        time.sleep(self.interval_s)
        self.flush(generation)

    def flush(self, generation: int | None = None) -> None:
        with self.lock:
            if generation is not None and generation != self.generation:
                return  # that buffer was flushed full already
            batch, self.buffer = self.buffer, []
            self.generation += 1
        if batch:
            result = tasks.sample_prompts.delay([w.prompt for w in batch])
            threading.Thread(target=self._deliver, args=(result.id, batch), daemon=True).start()

    def _deliver(self, task_id: str, batch: list[_Waiter]) -> None:
        try:
            completions = celery_app.AsyncResult(task_id).get(timeout=self.deadline_s)
        except CeleryTimeoutError:
            completions = [None] * len(batch)
        for waiter, completion in zip(batch, completions, strict=True):
            waiter.completion = completion
            waiter.done.set()


_batcher: TimerBatcher | None = None


@csrf_exempt
def timer(request: HttpRequest) -> HttpResponse:
    global _batcher
    started = time.monotonic()
    prompt = _prompt(request)
    if isinstance(prompt, HttpResponse):
        return prompt
    if _batcher is None:
        _batcher = TimerBatcher(
            bench_settings.BENCH_TIMER_MS / 1000,
            bench_settings.BENCH_FLUSH_EVERY,
            settings.SAMPLING_DEADLINE_MS / 1000,
        )
    waiter = _batcher.submit(prompt)
    remaining = started + settings.SAMPLING_DEADLINE_MS / 1000 - time.monotonic()
    if not waiter.done.wait(max(0.0, remaining)) or waiter.completion is None:
        return _timeout()
    return _text(200, waiter.completion)


@csrf_exempt
def plain_set(request: HttpRequest) -> HttpResponse:
    """One plain SET round trip to the request path's Redis per request, through the same
    gunicorn, client pool and load as /sample: what one SET costs that Redis when it comes the
    way requests come (python -m bench redis_cost compares /sample with it)."""
    prompt = _prompt(request)
    if isinstance(prompt, HttpResponse):
        return prompt
    redis_client().set(PLAIN_SET_KEY, prompt)
    return _text(200, prompt)
