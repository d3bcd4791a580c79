"""The model catalog: which models a deployment serves, and the aliases that split traffic
among them, as every web process sees it.

A model's name is its queue (its workers consume it, every Redis key of its aggregator is
under it); its kind says which endpoints take it (a generator: completions and chat; an
embedder: embeddings). An alias is a public name with weighted targets: a request to it goes
to one target by weight, the same one for the same caller (`Alias.pick`).

Two sources, merged: the models the environment lists (SAMPLING_MODELS, or the one
SAMPLING_QUEUE: `base_catalog`), and what operators register in the admin
(operations.models), published to Redis as one JSON value with a version, the way a policy is
(batching.policy). Each web process polls that key twice a second (`CatalogWatcher`); the
request path reads the process's copy: no database, no Redis call.

Django-free: a redis client and plain values in.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from decimal import Decimal, InvalidOperation
from functools import cached_property

import redis

from batching import scripts
from batching.keys import CATALOG_KEY
from batching.loop import PeriodicLoop

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.5

GENERATOR = "generator"
EMBEDDER = "embedder"
KINDS = (GENERATOR, EMBEDDER)
# The samplers (SAMPLER, SAMPLING_MODELS) that embed rather than generate: a model the
# environment lists with one of them is an embedder unless registered otherwise.
EMBEDDING_SAMPLERS = frozenset({"hf-embedder", "simulated-embedder"})
# The most an alias target's weight may be (weights are relative: 90 and 10 split 90/10).
MAX_WEIGHT = 1000
# An offline job's tokens pay this share of its model's prices unless the registry says
# otherwise: OpenAI's Batch API charges half.
DEFAULT_BATCH_PRICE_FACTOR = "0.5"


def kind_of_sampler(sampler: str) -> str:
    return EMBEDDER if sampler in EMBEDDING_SAMPLERS else GENERATOR


@dataclass(frozen=True)
class Price:
    """A model's prices as billionths of their unit per token: exact for prices of up to 6
    decimals per 1,000 tokens (the registry's), so a key's spend is an exact integer."""

    prompt_nanos: int = 0
    completion_nanos: int = 0

    @classmethod
    def per_thousand(cls, prompt: str, completion: str) -> Price:
        return cls(_nanos_per_token(prompt), _nanos_per_token(completion))

    def of(self, prompt_tokens: int, completion_tokens: int) -> int:
        return prompt_tokens * self.prompt_nanos + completion_tokens * self.completion_nanos

    def times(self, factor: str) -> Price:
        """These prices times `factor` (a decimal string), each rounded down to a whole
        billionth: the price an offline job's tokens pay (ModelEntry.batch_price)."""
        scale = Decimal(factor)
        if not 0 <= scale <= 1:
            raise ValueError(f"a price factor is between 0 and 1: {factor}")
        return Price(int(self.prompt_nanos * scale), int(self.completion_nanos * scale))


def _nanos_per_token(per_thousand: str) -> int:
    nanos = Decimal(per_thousand) * 1_000_000  # per 1,000 tokens x 1e9 / 1,000
    if nanos != nanos.to_integral_value() or nanos < 0:
        raise ValueError(f"a price has at most 6 decimals and is not negative: {per_thousand}")
    return int(nanos)


def nanos_as_decimal(nanos: int) -> str:
    """A spend in billionths as a decimal string of the price's unit ("0.000123")."""
    text = f"{Decimal(nanos).scaleb(-9):f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


@dataclass(frozen=True)
class ModelEntry:
    """A served model. Prices are per 1,000 tokens, as exact decimal strings."""

    name: str
    kind: str = GENERATOR
    description: str = ""
    prompt_price: str = "0"
    completion_price: str = "0"
    created: int = 0  # epoch seconds; 0: listed by the environment, not registered
    # What an offline job's tokens pay (the Batch API), as a share of the prices above.
    batch_price_factor: str = DEFAULT_BATCH_PRICE_FACTOR

    @property
    def generates(self) -> bool:
        return self.kind == GENERATOR

    @cached_property
    def price(self) -> Price:
        """Parsed once per entry (every answer is charged with it)."""
        return Price.per_thousand(self.prompt_price, self.completion_price)

    @cached_property
    def batch_price(self) -> Price:
        """What an offline job's tokens pay: the price times `batch_price_factor`."""
        return self.price.times(self.batch_price_factor)


@dataclass(frozen=True)
class Target:
    model: str
    weight: int
    canary: bool = False


@dataclass(frozen=True)
class Alias:
    """A public name for one of its targets, chosen by weight per request."""

    name: str
    targets: tuple[Target, ...]
    created: int = 0

    def pick(self, sticky: str = "", usable: Callable[[str], bool] | None = None) -> str | None:
        """The target model of a request: by weight, the same one for the same `sticky`
        (an API key, or the request's `user`), at random without one; None when every
        weight is 0. A sticky choice is weighted rendezvous hashing: each target scores
        `weight / -ln(u)`, `u` a hash of the alias, `sticky` and the target in (0, 1), and the
        highest score wins. So a weight change moves only the users it must: a target whose
        weight rises only gains users, and a target removed or set to 0 loses only its own.
        `usable` (failover) leaves out the targets it refuses while another is left: a user
        of a refused target goes to its next-highest score, and comes back after."""
        live = [target for target in self.targets if target.weight > 0]
        if usable is not None and len(live) > 1:
            live = [target for target in live if usable(target.model)] or live
        if not live:
            return None
        if sticky:
            return max(live, key=lambda target: self._score(target, sticky)).model
        point = random.randrange(sum(target.weight for target in live))  # noqa: S311 - a split
        for target in live:
            if point < target.weight:
                return target.model
            point -= target.weight
        raise AssertionError("unreachable: point < total")  # pragma: no cover

    def _score(self, target: Target, sticky: str) -> float:
        digest = hashlib.sha256(f"{self.name}\0{sticky}\0{target.model}".encode()).digest()
        # 52 bits, so that n + 0.5 is exact in a float: `unit` is in (0, 1), never 0 or 1.
        unit = ((int.from_bytes(digest[:8], "big") >> 12) + 0.5) / 2**52
        return target.weight / -math.log(unit)


@dataclass(frozen=True)
class Catalog:
    models: Mapping[str, ModelEntry] = field(default_factory=dict)
    aliases: Mapping[str, Alias] = field(default_factory=dict)
    # When its newest change was made (µs since the epoch; 0: the environment's models alone,
    # never published): a publisher never replaces a newer one.
    version: int = 0

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": self.version,
                "models": [asdict(entry) for entry in self.models.values()],
                "aliases": [asdict(alias) for alias in self.aliases.values()],
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> Catalog:
        data = json.loads(raw)
        models = [ModelEntry(**entry) for entry in data.get("models", [])]
        aliases = [
            Alias(alias["name"], tuple(Target(**t) for t in alias["targets"]), alias["created"])
            for alias in data.get("aliases", [])
        ]
        catalog = cls.of(models, aliases, int(data.get("version", 0)))
        problems = catalog.problems()
        if problems:
            raise ValueError("; ".join(problems))
        return catalog

    @classmethod
    def of(
        cls, models: Iterable[ModelEntry], aliases: Iterable[Alias] = (), version: int = 0
    ) -> Catalog:
        return cls({entry.name: entry for entry in models}, {a.name: a for a in aliases}, version)

    def problems(self) -> list[str]:
        found = []
        for entry in self.models.values():
            if entry.kind not in KINDS:
                found.append(f"model {entry.name!r}: kind must be one of {', '.join(KINDS)}")
            try:
                entry.price  # noqa: B018 - checks both prices
            except (ValueError, InvalidOperation):
                found.append(f"model {entry.name!r}: prices are decimals of up to 6 places")
            try:
                entry.batch_price  # noqa: B018 - checks the factor
            except (ValueError, InvalidOperation):
                found.append(f"model {entry.name!r}: the batch price factor is 0 to 1")
        for alias in self.aliases.values():
            if alias.name in self.models:
                found.append(f"alias {alias.name!r} has the name of a model")
            for target in alias.targets:
                if target.model not in self.models:
                    found.append(f"alias {alias.name!r}: no model {target.model!r}")
                if not 0 <= target.weight <= MAX_WEIGHT:
                    found.append(f"alias {alias.name!r}: weights are 0 to {MAX_WEIGHT}")
        return found

    def merged_over(self, base: Catalog) -> Catalog:
        """This (published) catalog over the environment's: a registered model replaces the
        listed one of its name; the version is this one's."""
        return replace(
            self, models={**base.models, **self.models}, aliases={**base.aliases, **self.aliases}
        )

    def names(self) -> list[str]:
        return sorted({*self.models, *self.aliases})


def base_catalog(models: Iterable[tuple[str, str]]) -> Catalog:
    """The environment's models: (name, sampler) pairs, each a generator or an embedder by
    its sampler."""
    return Catalog.of(ModelEntry(name, kind_of_sampler(sampler)) for name, sampler in models)


def publish(client: redis.Redis, catalog: Catalog, key: str = CATALOG_KEY) -> bool:
    """Make `catalog` the one every web process applies within POLL_INTERVAL_S; False when a
    newer version is already published. `key` is for tests that must not touch a running
    deployment's catalog."""
    problems = catalog.problems()
    if problems:
        raise ValueError("; ".join(problems))
    script = scripts.register(client, "publish")
    return bool(script(keys=[key], args=[catalog.to_json(), catalog.version]))


def published(client: redis.Redis, key: str = CATALOG_KEY) -> Catalog | None:
    raw = client.get(key)
    return None if raw is None else Catalog.from_json(raw)


class CatalogWatcher:
    """This process's copy of the catalog: the environment's models, with the published
    registrations over them, refreshed by polling one key."""

    def __init__(
        self,
        client: redis.Redis,
        base: Catalog,
        interval_s: float = POLL_INTERVAL_S,
        key: str = CATALOG_KEY,
    ) -> None:
        self.client = client
        self.base = base
        self.key = key
        self.current = base
        self._raw: bytes | None = None
        self.loop = PeriodicLoop("catalog-watcher", self.refresh, interval_s, "read the catalog")

    def refresh(self) -> bool:
        """Read the published catalog once; True when it changed. Raises redis errors."""
        raw = self.client.get(self.key)
        if raw == self._raw:
            return False
        self._raw = raw
        try:
            catalog = self.base if raw is None else Catalog.from_json(raw).merged_over(self.base)
        except (ValueError, TypeError, KeyError) as exc:
            log.error("ignoring an invalid published catalog: %s", exc)
            return False
        if catalog == self.current:
            return False
        self.current = catalog
        log.info("catalog version %d applied: %s", catalog.version, ", ".join(catalog.names()))
        return True

    def start(self) -> CatalogWatcher:
        self.loop.run_once()
        self.loop.start()
        return self

    def stop(self) -> None:
        self.loop.stop()
