"""Which model serves a request, from its `model`: the body's on /v1, the `model` query
parameter on /sample and /api/inference, else the default model (SAMPLING_QUEUE).

An alias resolves to one of its targets by weight (batching.catalog.Alias.pick): the same one
for the same `user`, else for the same API key; an anonymous request without `user` is split
per request. The model must be of the endpoint's kind (a generator for completions and chat,
an embedder for embeddings) and have a live worker (one that heartbeated within the
heartbeat timeout, as this process read twice a second): a model without one gets a fast 503
saying so, not a wait until the deadline, counted on that model (`Unrouted`).

With failover on (SAMPLING_ALIAS_FAILOVER), an alias's target with no live worker, or cooling
down after failures in a row (`ServedModel.usable`), gets no new requests while another target
is usable: its users go to their next choice by rendezvous hashing, and come back after. All of
it in memory: no Redis call, but for a model whose "no live worker" is older than 50 ms.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, replace

from django.conf import settings

from accounts.access import Caller
from batching.catalog import EMBEDDER, GENERATOR, ModelEntry
from batching.problems import Failure, Problem
from batching.registry import HEARTBEAT_TIMEOUT_MS
from serving.responses import Invalid
from serving.runtime import ServedModel, WebProcess

# The names a 404 lists, at most (a deployment with hundreds of models lists them at /v1/models).
NAMES_LISTED = 20
RETRY_NO_WORKER_S = max(1, HEARTBEAT_TIMEOUT_MS // 1000)
# The failures of a request through an alias that send it once more, to another target
# (SAMPLING_ALIAS_RETRY): both came before any text reached the client.
RETRIED = (Problem.SAMPLER_FAILED, Problem.OVERLOADED)
# The alias the request being handled came through ("" for none): its statistics name it too.
ROUTED_VIA: ContextVar[str] = ContextVar("routed_via", default="")


@dataclass(frozen=True)
class Route:
    served: ServedModel  # the model that serves the request
    entry: ModelEntry  # its catalog entry
    requested: str  # what the request named: the model, or an alias of it


@dataclass(frozen=True)
class Unrouted:
    """A request refused at routing for want of capacity: the 503, and the model chosen for
    it (None: an alias with no target left), whose statistics count it."""

    failure: Failure
    served: ServedModel | None


def sticky_of(caller: Caller, user: str | None) -> str:
    """What keeps a caller on one target of an alias: its `user`, else its key; "" for an
    anonymous request without `user` (split per request)."""
    if user:
        return f"user:{user}"
    return key_sticky(caller.key_id) if caller.key_id else ""


def key_sticky(key_id: int) -> str:
    """What keeps an API key's requests, and its offline jobs, on one target of an alias."""
    return f"key:{key_id}"


def route(
    process: WebProcess,
    requested: str | None,
    kind: str = GENERATOR,
    sticky: str = "",
    param: str = "model",
) -> Route | Unrouted:
    """The model of a request that names `requested` (None: the default model), or the 503
    of a model without a live worker (or an alias with no target left). Raises `Invalid`:
    404 for a name the catalog does not have, 400 for a model of another kind."""
    catalog = process.catalog.current
    name = requested or process.default_model
    alias = catalog.aliases.get(name)
    if alias is not None:
        usable = process.usable if settings.SAMPLING_ALIAS_FAILOVER else None
        target = alias.pick(sticky, usable)
        if target is None:
            failure = Failure(
                Problem.MODEL_UNAVAILABLE,
                f"the model {name!r} has no target with a weight above 0",
                RETRY_NO_WORKER_S,
            )
            return Unrouted(failure, None)
        ROUTED_VIA.set(name)
        name = target
    entry = catalog.models.get(name)
    if entry is None:
        names = catalog.names()
        listed = ", ".join(repr(n) for n in names[:NAMES_LISTED])
        more = f" and {len(names) - NAMES_LISTED} more" if len(names) > NAMES_LISTED else ""
        raise Invalid(
            f"the model {name!r} does not exist: this server serves {listed}{more}",
            param,
            status=404,
            code="model_not_found",
        )
    if entry.kind != kind:
        raise Invalid(
            f"the model {name!r} is an embedder: send it to /v1/embeddings"
            if entry.kind == EMBEDDER
            else f"the model {name!r} generates text: it has no embeddings",
            param,
            code="model_not_supported",
        )
    served = process.model(name)
    if not served.has_live_worker():
        failure = Failure(
            Problem.MODEL_UNAVAILABLE,
            f"the model {name!r} has no live worker (none heartbeated in the last "
            f"{HEARTBEAT_TIMEOUT_MS} ms)",
            RETRY_NO_WORKER_S,
        )
        return Unrouted(failure, served)
    return Route(served, entry, requested or name)


def fallback(process: WebProcess, failed: Route, failure: Failure, sticky: str) -> Route | None:
    """Where a request through an alias goes for its one retry: the caller's next choice
    among the alias's other usable targets of the same kind; None when the failure is not
    retried, SAMPLING_ALIAS_RETRY is off or no other target is usable."""
    via = ROUTED_VIA.get()
    if not via or failure.problem not in RETRIED or not settings.SAMPLING_ALIAS_RETRY:
        return None
    catalog = process.catalog.current
    alias = catalog.aliases.get(via)
    if alias is None:
        return None
    others = tuple(
        target
        for target in alias.targets
        if target.model != failed.served.name and process.usable(target.model)
    )
    name = replace(alias, targets=others).pick(sticky)
    entry = catalog.models.get(name) if name is not None else None
    if name is None or entry is None or entry.kind != failed.entry.kind:
        return None
    other = process.model(name)
    checked, to_meet = failed.served.watcher.current, other.watcher.current
    if (to_meet.max_prompt_bytes < checked.max_prompt_bytes
            or to_meet.max_new_tokens < checked.max_new_tokens):  # fmt: skip
        return None  # the request was checked against limits the other target does not have
    return Route(other, entry, failed.requested)
