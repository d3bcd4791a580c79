"""The sampling policy of one queue, as every web process and worker of that queue sees it.

Operators edit it in the Django admin (operations.models.SamplingPolicy); a save publishes it to
Redis as one JSON value with a version number, and each process polls that one key twice a
second from a background thread (a greenlet under gevent). The request path only reads the
process's copy: no database query and no extra Redis call per request. Without a published
policy, the environment's settings (SAMPLING_*) are the policy, version 0.

This module is the one home of the policy's bounds and defaults: the environment's settings,
the admin's form, the sampler's generation settings and the capacity planner read them here.
It knows nothing of Django: it takes a redis client and plain values.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import redis

from batching import scripts
from batching.keys import QueueKeys
from batching.loop import PeriodicLoop

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.5

# The model's sampling call takes 1 to this many prompts (the problem's contract).
MAX_BATCH_SIZE = 100

# Bounds shared by the environment settings, the admin form, published values and the
# sampler's generation settings: name -> (minimum, maximum). Temperature 0 is greedy; top-p
# must also be above 0.
BOUNDS: dict[str, tuple[float, float]] = {
    "max_batch_size": (1, MAX_BATCH_SIZE),
    "deadline_ms": (1, 600_000),
    "max_prompt_bytes": (1, 1 << 20),
    "max_new_tokens": (1, 4096),
    "temperature": (0.0, 100.0),
    "top_p": (0.0, 1.0),
    "fill_target_percent": (1, 100),
    "response_cache_ttl_s": (1, 7 * 24 * 3600),
}


def problems_of(values: object, names: tuple[str, ...]) -> list[str]:
    """Every bound of BOUNDS that the attributes `names` of `values` break, one readable line
    each; empty when all hold."""
    found = []
    for name in names:
        low, high = BOUNDS[name]
        value = getattr(values, name)
        if not low <= value <= high:
            found.append(
                f"{name} must be between {number(low)} and {number(high)}, got {number(value)}"
            )
        if name == "top_p" and value <= 0:
            found.append(f"top_p must be above 0, got {number(value)}")
    return found


@dataclass(frozen=True)
class GenerationSettings:
    """How a model continues a prompt: the generation part of the policy, which a sampler
    applies (workers.samplers.Sampler.configure)."""

    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy, deterministic
    top_p: float = 1.0
    stop: str = ""  # cut the completion before the first occurrence; "" for none

    def __post_init__(self) -> None:
        problems = problems_of(self, ("max_new_tokens", "temperature", "top_p"))
        if problems:
            raise ValueError("; ".join(problems))


_GENERATION = GenerationSettings()


@dataclass(frozen=True)
class Policy:
    max_batch_size: int = MAX_BATCH_SIZE
    deadline_ms: int = 500
    max_prompt_bytes: int = 8192
    max_new_tokens: int = _GENERATION.max_new_tokens
    temperature: float = _GENERATION.temperature
    top_p: float = _GENERATION.top_p
    stop: str = _GENERATION.stop
    # The batch fill the GPU-count recommendation plans for: 100% leaves no headroom.
    fill_target_percent: int = 90
    # Answer a request whose completion its input determines (greedy, or a seed) from the
    # completion of an identical earlier one, for this long after it was sampled.
    response_cache: bool = False
    response_cache_ttl_s: int = 300
    # Share cached answers across API keys (off: each key has its own). On, a key can learn
    # that another sent the same request within the TTL (x-cache: hit, a fast answer).
    response_cache_shared: bool = False
    version: int = 0  # 0: the environment's defaults, never published

    def problems(self) -> list[str]:
        """Every bound this policy breaks, one readable line each; empty when valid."""
        return problems_of(self, tuple(BOUNDS))

    @property
    def generation(self) -> GenerationSettings:
        return GenerationSettings(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stop=self.stop,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> Policy:
        data = json.loads(raw)
        known = {f.name for f in fields(cls)}
        policy = cls(**{name: value for name, value in data.items() if name in known})
        problems = policy.problems()
        if problems:
            raise ValueError("; ".join(problems))
        return policy

    def changes_from(self, other: Policy) -> dict[str, tuple[object, object]]:
        """name -> (other's value, this value) for each setting that differs (not version)."""
        return {
            f.name: (getattr(other, f.name), getattr(self, f.name))
            for f in fields(self)
            if f.name != "version" and getattr(other, f.name) != getattr(self, f.name)
        }


# The environment's setting of each field, read by inference_site.settings.
SETTING_NAMES = {
    "max_batch_size": "SAMPLING_MAX_BATCH_SIZE",
    "deadline_ms": "SAMPLING_DEADLINE_MS",
    "max_prompt_bytes": "SAMPLING_MAX_PROMPT_BYTES",
    "max_new_tokens": "SAMPLING_MAX_NEW_TOKENS",
    "temperature": "SAMPLING_TEMPERATURE",
    "top_p": "SAMPLING_TOP_P",
    "stop": "SAMPLING_STOP",
    "fill_target_percent": "SAMPLING_FILL_TARGET_PERCENT",
    "response_cache": "SAMPLING_RESPONSE_CACHE",
    "response_cache_ttl_s": "SAMPLING_RESPONSE_CACHE_TTL_S",
    "response_cache_shared": "SAMPLING_RESPONSE_CACHE_SHARED",
}


def policy_from_settings(settings: object) -> Policy:
    """The environment's policy (version 0), the policy of a queue without a published one:
    `settings` is django.conf.settings, or any object with the SAMPLING_* attributes."""
    return Policy(**{field: getattr(settings, name) for field, name in SETTING_NAMES.items()})


def number(value: float) -> str:
    """1,048,576 for an int, 0.7 for a float: bounds as an operator reads them."""
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


def publish(client: redis.Redis, queue: str, policy: Policy) -> bool:
    """Make `policy` the one every process of `queue` applies within POLL_INTERVAL_S; False
    when a newer version is already published."""
    problems = policy.problems()
    if problems:
        raise ValueError("; ".join(problems))
    script = scripts.register(client, "publish")
    return bool(script(keys=[QueueKeys(queue).policy], args=[policy.to_json(), policy.version]))


def withdraw(client: redis.Redis, queue: str) -> None:
    """Back to the environment's defaults (the policy row was deleted)."""
    client.delete(QueueKeys(queue).policy)


class PolicyWatcher:
    """This process's copy of the queue's policy, refreshed by polling one Redis key."""

    def __init__(
        self,
        client: redis.Redis,
        queue: str,
        defaults: Policy,
        interval_s: float = POLL_INTERVAL_S,
    ) -> None:
        self.client = client
        self.queue = queue
        self.key = QueueKeys(queue).policy
        self.defaults = defaults
        self.current = defaults
        self._raw: bytes | None = None
        self._listeners: list[Callable[[Policy], None]] = []
        self.loop = PeriodicLoop(
            "policy-watcher", self.refresh, interval_s, f"read the policy of {queue}"
        )

    def on_change(self, listener: Callable[[Policy], None]) -> None:
        """Call `listener(policy)` now and whenever the policy changes (from the poller)."""
        self._listeners.append(listener)
        listener(self.current)

    def refresh(self) -> bool:
        """Read the published policy once; True when it changed. Raises redis errors."""
        raw = self.client.get(self.key)
        if raw == self._raw:
            return False
        self._raw = raw
        if raw is None:
            policy = self.defaults
        else:
            try:
                policy = Policy.from_json(raw)
            except (ValueError, TypeError) as exc:
                # A bad value must not take the service down: keep the last good one.
                log.error("ignoring an invalid published policy for %s: %s", self.queue, exc)
                return False
        if policy == self.current:
            return False
        # Listeners first: whoever reads `current` sees a policy already applied everywhere.
        for listener in self._listeners:
            try:
                listener(policy)
            except Exception:  # one failing listener must not keep the policy from the others
                log.exception("a policy listener failed")
        previous, self.current = self.current, policy
        log.info(
            "queue %s: policy version %d applied (%s)",
            self.queue,
            policy.version,
            ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in policy.changes_from(previous).items())
            or "no setting changed",
        )
        return True

    def start(self) -> PolicyWatcher:
        """Read the policy now (the first request or batch must not see the defaults for one
        interval), then poll it in a daemon thread."""
        self.loop.run_once()  # a failure is logged, and the loop tries again
        self.loop.start()
        return self

    def stop(self) -> None:
        self.loop.stop()
