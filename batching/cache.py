"""The response cache: which requests it may answer, and the digest that names their answer.

A request's completion is determined by its input when it is greedy (temperature 0) or
seeded: an identical request (same model, same prompt or messages, every generation setting
as resolved against the queue's policy, same endpoint shape) gets exactly the completion the
first one was sampled, from Redis, without a GPU. The web process decides, from its copy of
the policy (`response_cache`, off by default); the request's one Redis call looks the digest
up (batching.aggregator, `append_items`), and the worker that samples a miss stores its
answer for `response_cache_ttl_s` (workers.runner) under the digest of what it ran: its own
policy (settings and version), whatever the web process's copy said.

Entries are scoped per API key (anonymous requests share one scope): another key's identical
request is a miss, so the cache tells no tenant what another asked. `response_cache_shared`
shares them across keys; it reveals, by `x-cache: hit` and a fast answer, that some key sent
the same request within the TTL. An entry names its policy version, and a lookup finds none
of a version older than the workers' (their heartbeats set it on every shard): once every
live worker runs a new policy, no answer sampled under an older one is served.

Django- and model-free.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

from batching.generation import RowSettings, SampleRequest
from batching.policy import Policy


def settings_of(item: str | SampleRequest, policy: Policy) -> RowSettings:
    """The item's settings as the worker will resolve them (the policy's where it sets none)."""
    if isinstance(item, str):
        return RowSettings.of(policy.generation)
    return item.settings(policy.generation)


def cacheable(settings: RowSettings) -> bool:
    """Whether the completion is determined by the input: greedy, or a fixed seed."""
    return settings.greedy or settings.seed is not None


def digest_of(queue: str, item: str | SampleRequest, policy: Policy, key_id: int = 0) -> str:
    """The cache's name of the item's answer under `policy` for API key `key_id` (0:
    anonymous): "" when the cache is off or the item's output is not determined by its input.
    What determines the output is in it: the queue (its model), the policy's version, the
    endpoint's shape, the prompt and every resolved setting; and the key, unless the policy
    shares answers across keys (`response_cache_shared`)."""
    if not policy.response_cache:
        return ""
    settings = settings_of(item, policy)
    if not cacheable(settings):
        return ""
    # /sample's answer (the text) and the API's (text, finish reason, tokens) differ in shape.
    shape, text = ("sample", item) if isinstance(item, str) else ("api", item.to_json())
    scope = "shared" if policy.response_cache_shared else key_id
    canonical = json.dumps(
        [queue, policy.version, scope, shape, text, asdict(settings)], sort_keys=True
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]
