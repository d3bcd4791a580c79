"""The Django seam of the request path: small wrappers that make a view of a handler.

- `counted(handle, words)`: a generating endpoint (/sample, /v1 completions and chat,
  /api/inference): shed, authenticated, rate limited, counted.
- `openai_endpoint(*methods, key_for=...)(view)`: an endpoint of the API that generates
  nothing (/v1/models, /v1/usage, files and batches): 405 for another method,
  authenticated (a key required where `key_for` says why), its refusals in OpenAI's error
  JSON; `openai_get` for the GETs.
- `authenticate(request, process)` and `answer_failure(words, failure)`: the two steps both
  share, usable alone.

What happens to a request's items between (join, dispatch, wait) is Django-free
(serving.submission); how each endpoint words a refusal is serving.responses.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Concatenate, NamedTuple, ParamSpec

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.http.response import HttpResponseBase
from django.views.decorators.csrf import csrf_exempt

from accounts.access import Caller
from batching.generation import SampleRequest
from batching.outcomes import RequestOutcome
from batching.problems import Failure, Problem
from batching.topology import REDIS_FAULTS
from serving import metrics
from serving.deadline import Deadline
from serving.responses import Invalid, openai_failure, openai_invalid
from serving.routing import ROUTED_VIA, Route, Unrouted, fallback
from serving.runtime import ServedModel, WebProcess, web_process
from serving.shedding import JOINED_AT, ShedReason
from serving.streams import Stream
from serving.submission import Answers, submit

log = logging.getLogger(__name__)

P = ParamSpec("P")

# The outcomes that tell an alias's target works (OK) or fails (ERROR): the rest say nothing.
COOLDOWN_OUTCOMES = (RequestOutcome.OK, RequestOutcome.ERROR)


class Handled(NamedTuple):
    """What a handler made of a request: its outcome, its response, the model whose
    statistics count it (None: the default model's, as for a request refused before it
    named one), for a streaming response its end, where it is counted instead, the alias
    the request came through, and whether it was refused for want of a live worker."""

    outcome: RequestOutcome
    response: HttpResponseBase
    model: ServedModel | None = None
    stream: Stream | None = None
    via: str = ""
    no_worker: bool = False


def unrouted(words: Words, found: Unrouted) -> Handled:
    """A request refused at routing, counted on the model chosen for it."""
    failure = found.failure
    response = answer_failure(words, failure)
    return Handled(failure.outcome, response, found.served, no_worker=True)


Handler = Callable[[HttpRequest, WebProcess, float, Caller], Handled]

Words = Callable[[Failure], HttpResponse]  # how an endpoint says a Failure
View = Callable[[HttpRequest], HttpResponseBase]


def authenticate(request: HttpRequest, process: WebProcess) -> Caller | Failure:
    """The request's caller, from its Authorization header and this process's copy of the
    keys (no Redis call): a 401 Failure for a missing key (when SAMPLING_REQUIRE_API_KEY is
    on), a malformed header, or an unknown, revoked or expired key; anonymous otherwise."""
    found = process.access.identify(
        request.META.get("HTTP_AUTHORIZATION"), settings.SAMPLING_REQUIRE_API_KEY
    )
    if isinstance(found, Caller):
        return found
    if found is None:  # the keys were never read: Redis away since this process started
        return Failure(Problem.UNAVAILABLE, "API keys cannot be checked yet")
    return Failure(Problem.UNAUTHORIZED, str(found))


def answer_failure(words: Words, failure: Failure) -> HttpResponse:
    """An endpoint's wording of `failure`, with the headers its problem asks for."""
    response = words(failure)
    for name, value in failure.headers().items():
        response[name] = value
    return response


def counted(handle: Handler, words: Words) -> View:
    """A view around `handle(request, process, arrival, caller)`: the request shed first if
    this process cannot start it in time (serving.shedding), its deadline counted from its
    arrival (`X-Request-Start`, else when its bytes reached the kernel, else now); then the
    caller authenticated and checked against its rate limits first (a refusal worded by
    `words`), every answer to a limited caller with its x-ratelimit-* headers, and every
    request counted in memory (statistics flushed to Redis once a second) and in this
    process's Prometheus file, with no round trip on the request path. CSRF does not apply
    to the API (no cookies)."""

    @csrf_exempt
    def view(request: HttpRequest) -> HttpResponseBase:
        process = web_process()
        arrival = process.shedder.arrival(request.META)  # the deadline counts from here
        JOINED_AT.set(None)  # a keep-alive connection's greenlet served requests before
        ROUTED_VIA.set("")
        started = time.monotonic()
        shed = _shed(process, arrival)
        caller: Caller | Failure
        handled: Handled | None = None
        if shed is not None:
            reason, caller = shed
            metrics.record_shed(reason)
            handled = Handled(caller.outcome, answer_failure(words, caller))
        else:
            process.shedder.in_flight += 1
            try:
                caller, handled = _admitted(request, process, arrival, handle, words)
            except REDIS_FAULTS as exc:  # whatever step met Redis away: a 503, never a 500
                caller = redis_away(exc)
                handled = Handled(caller.outcome, answer_failure(words, caller))
            finally:
                if handled is None or handled.stream is None:
                    process.shedder.in_flight -= 1
        if ROUTED_VIA.get():
            handled = handled._replace(via=ROUTED_VIA.get())
        if handled.stream is not None:  # its slot held, and counted, until it closes
            ended = handled
            handled.stream.on_close(
                lambda outcome: _count(
                    process, ended._replace(outcome=outcome), caller, arrival, in_flight=True
                )
            )
        else:
            _learn(handled, started)
            _count(process, handled, caller, arrival)
        return handled.response

    view.__name__ = view.__qualname__ = handle.__name__.lstrip("_")
    return view


def _learn(handled: Handled, started: float) -> None:
    """A model's answer (not a cache hit's) teaches it the least work of its requests."""
    model, hit = handled.model, handled.response.get("x-cache") == "hit"
    if handled.outcome == RequestOutcome.OK and model is not None and not hit:
        model.quickest.record(time.monotonic() - started)


def _count(
    process: WebProcess,
    handled: Handled,
    caller: Caller | Failure,
    arrival: float,
    *,
    in_flight: bool = False,
) -> None:
    """A request counted as it ends (`in_flight`: its slot given back too, a stream's), on
    the model chosen for it (and the alias it came through)."""
    model, outcome = handled.model, handled.outcome
    if in_flight:
        process.shedder.in_flight -= 1
    latency_s = time.monotonic() - arrival
    if outcome == RequestOutcome.TIMEOUT and not in_flight:  # a stream's length is its own
        deadline_ms = (model or process.default).watcher.current.deadline_ms
        process.shedder.timed_out(arrival, JOINED_AT.get(), deadline_ms)
    key_id = 0 if isinstance(caller, Failure) else caller.key_id
    tier = "" if isinstance(caller, Failure) else caller.tier
    (model or process.default).stats.record(
        outcome, latency_s, key_id=key_id, tier=tier, via=handled.via, no_worker=handled.no_worker
    )
    if model is not None and handled.via and outcome in COOLDOWN_OUTCOMES:
        model.ended(failed=outcome == RequestOutcome.ERROR and not handled.no_worker)
    metrics.record_request(outcome, latency_s, tier)


def submitted(
    found: Route,
    caller: Caller,
    items: Sequence[str | SampleRequest],
    deadline: Deadline,
    sticky: str,
) -> tuple[Route, Answers | Failure]:
    """A request's items through its model's batches, and the route that answered. Through
    an alias, a failure before any text reached the client is sent once more, within the
    same deadline, to the caller's next choice among the other targets (routing.fallback)."""
    answers = submit(found.served, caller, items, deadline, price=found.entry.price)
    if not isinstance(answers, Failure):
        return found, answers
    other = fallback(web_process(), found, answers, sticky)
    if other is None or deadline.passed():
        return found, answers
    count_retried(found.served, deadline.arrival, answers)
    return other, submit(other.served, caller, items, deadline, price=other.entry.price)


def count_retried(model: ServedModel, arrival: float, failure: Failure) -> None:
    """The first try of a request sent again to another target of its alias: counted on its
    own target too (not in the key's usage, which counts the request once, as it ends)."""
    latency_s = time.monotonic() - arrival
    model.stats.record(failure.outcome, latency_s, via=ROUTED_VIA.get())
    if failure.outcome in COOLDOWN_OUTCOMES:
        model.ended(failed=failure.outcome == RequestOutcome.ERROR)


def redis_away(exc: Exception) -> Failure:
    """The 503 of a request whose Redis call failed where no step turned it into one (on a
    cluster, a RedisClusterException is not even a RedisError)."""
    log.error("Redis unavailable for a request: %r", exc)
    return Failure(Problem.UNAVAILABLE, "service unavailable: Redis does not answer")


def _admitted(
    request: HttpRequest, process: WebProcess, arrival: float, handle: Handler, words: Words
) -> tuple[Caller | Failure, Handled]:
    """A request this process started: authenticated, rate limited, handled."""
    caller = authenticate(request, process)
    if isinstance(caller, Failure):
        return caller, Handled(caller.outcome, answer_failure(words, caller))
    limited = process.limiter.check(caller)
    spent = process.budgets.refusal(caller)
    if spent is not None:
        refusal = Failure(Problem.OVER_BUDGET, spent)
        return caller, Handled(refusal.outcome, answer_failure(words, refusal))
    if limited is not None:
        refusal = Failure(Problem.RATE_LIMITED, limited.message, limited.retry_after_s)
        handled = Handled(refusal.outcome, answer_failure(words, refusal))
    else:
        handled = handle(request, process, arrival, caller)
    limiter = handled.model.limiter if handled.model is not None else process.limiter
    for header, value in limiter.headers(caller).items():
        handled.response[header] = value
    return caller, handled


def _shed(process: WebProcess, arrival: float) -> tuple[ShedReason, Failure] | None:
    """Why this process refuses to start the request, and the refusal; None to start it."""
    shedder = process.shedder
    deadline_ms = process.watcher.current.deadline_ms
    reason = shedder.refusal(arrival, deadline_ms)
    if reason is None:
        return None
    if reason == ShedReason.IN_FLIGHT and shedder.limit < shedder.max_in_flight:
        message = (
            f"overloaded: this web process answered requests late: its in-flight limit is "
            f"lowered to {int(shedder.limit)} requests for now"
        )
    elif reason == ShedReason.IN_FLIGHT:
        message = f"overloaded: this web process holds {shedder.max_in_flight} requests already"
    else:
        waited_ms = (time.monotonic() - arrival) * 1000
        message = (
            f"overloaded: the request waited {waited_ms:.0f} ms of its {deadline_ms} ms "
            "deadline before this server could start it"
        )
    return reason, Failure(Problem.OVERLOADED, message)


def require_method(request: HttpRequest, *methods: str) -> None:
    if request.method not in methods:
        raise Invalid(f"use {' or '.join(methods)} on {request.path}", status=405,
                      code="method_not_allowed", headers={"Allow": ", ".join(methods)})  # fmt: skip


def require_get(request: HttpRequest) -> None:
    require_method(request, "GET", "HEAD")


def require_key(caller: Caller, why: str) -> None:
    """401 for an anonymous caller of an endpoint whose objects belong to a key (`why`)."""
    if caller.key_id == 0:
        raise Invalid(f"{why}: send Authorization: Bearer <key>", status=401,
                      code="missing_api_key",
                      headers={"WWW-Authenticate": 'Bearer realm="sampling"'})  # fmt: skip


KeyedView = Callable[Concatenate[HttpRequest, Caller, P], HttpResponseBase | Failure]


def openai_endpoint(
    *methods: str, key_for: str = ""
) -> Callable[[KeyedView[P]], Callable[Concatenate[HttpRequest, P], HttpResponseBase]]:
    """An endpoint of the API around `view(request, caller, ...)`: another method than
    `methods` gets 405 (not the CSRF page), the caller is authenticated (401; with `key_for`,
    why a key is needed, an anonymous caller too), and what the view refuses (an `Invalid`
    raised, a `Failure` returned, Redis away) is worded in OpenAI's error JSON."""

    def decorate(view: KeyedView[P]) -> Callable[Concatenate[HttpRequest, P], HttpResponseBase]:
        @csrf_exempt
        @functools.wraps(view)
        def wrapped(request: HttpRequest, /, *args: P.args, **kwargs: P.kwargs) -> HttpResponseBase:
            try:
                require_method(request, *methods)
                caller = authenticate(request, web_process())
                if isinstance(caller, Failure):
                    return answer_failure(openai_failure, caller)
                if key_for:
                    require_key(caller, key_for)
                answer = view(request, caller, *args, **kwargs)
            except Invalid as invalid:
                return openai_invalid(invalid)
            except REDIS_FAULTS as exc:
                answer = redis_away(exc)
            if isinstance(answer, Failure):
                return answer_failure(openai_failure, answer)
            return answer

        return wrapped

    return decorate


# A GET endpoint of the API (/v1/models, /v1/usage).
openai_get = openai_endpoint("GET", "HEAD")
