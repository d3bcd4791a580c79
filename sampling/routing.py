"""Which model serves a request, from its `model`: the body's on /v1, the `model` query
parameter on /sample and /api/inference, else the default model (SAMPLING_QUEUE).

An alias resolves to one of its targets by weight (batching.catalog.Alias.pick): the same one
for the same `user`, else for the same API key; an anonymous request without `user` is split
per request. The model must be of the endpoint's kind (a generator for completions and chat,
an embedder for embeddings) and have a live worker (one that heartbeated within the
heartbeat timeout, as this process read twice a second): a model without one gets a fast 503
saying so, not a wait until the deadline. All of it in memory: no Redis call.
"""

from __future__ import annotations

from dataclasses import dataclass

from batching.access import Caller
from batching.catalog import EMBEDDER, GENERATOR, ModelEntry
from batching.problems import Failure, Problem
from batching.registry import HEARTBEAT_TIMEOUT_MS
from sampling.responses import Invalid
from sampling.runtime import ServedModel, WebProcess

# The names a 404 lists, at most (a deployment with hundreds of models lists them at /v1/models).
NAMES_LISTED = 20
RETRY_NO_WORKER_S = max(1, HEARTBEAT_TIMEOUT_MS // 1000)


@dataclass(frozen=True)
class Route:
    served: ServedModel  # the model that serves the request
    entry: ModelEntry  # its catalog entry
    requested: str  # what the request named: the model, or an alias of it


def sticky_of(caller: Caller, user: str | None) -> str:
    """What keeps a caller on one target of an alias: its `user`, else its key; "" for an
    anonymous request without `user` (split per request)."""
    if user:
        return f"user:{user}"
    return f"key:{caller.key_id}" if caller.key_id else ""


def route(
    process: WebProcess,
    requested: str | None,
    kind: str = GENERATOR,
    sticky: str = "",
    param: str = "model",
) -> Route | Failure:
    """The model of a request that names `requested` (None: the default model), or the 503
    of a model without a live worker (or an alias with no target left). Raises `Invalid`:
    404 for a name the catalog does not have, 400 for a model of another kind."""
    catalog = process.catalog.current
    name = requested or process.default_model
    alias = catalog.aliases.get(name)
    if alias is not None:
        target = alias.pick(sticky)
        if target is None:
            return Failure(
                Problem.MODEL_UNAVAILABLE,
                f"the model {name!r} has no target with a weight above 0",
                RETRY_NO_WORKER_S,
            )
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
        return Failure(
            Problem.MODEL_UNAVAILABLE,
            f"the model {name!r} has no live worker (none heartbeated in the last "
            f"{HEARTBEAT_TIMEOUT_MS} ms)",
            RETRY_NO_WORKER_S,
        )
    return Route(served, entry, requested or name)
