from __future__ import annotations

import uuid
from collections import Counter

import pytest
import redis

from batching.catalog import (
    DEFAULT_BATCH_PRICE_FACTOR,
    EMBEDDER,
    GENERATOR,
    Alias,
    Catalog,
    CatalogWatcher,
    ModelEntry,
    Target,
    base_catalog,
    publish,
)
from inference_site.lib.env import ImproperlyConfigured, env_models

SPLIT = Alias("chat", (Target("chat-v1", 90), Target("chat-v2", 10, canary=True)))
CATALOG = Catalog.of(
    [ModelEntry("chat-v1"), ModelEntry("chat-v2"), ModelEntry("embed", EMBEDDER)], [SPLIT], 7
)


def test_a_sticky_split_follows_the_weights_and_keeps_each_caller_on_one_target() -> None:
    picks = Counter(SPLIT.pick(f"key:{key_id}") for key_id in range(5000))
    assert abs(picks["chat-v2"] / 5000 - 0.10) < 0.02
    assert sum(picks.values()) == 5000
    for key_id in range(50):
        assert len({SPLIT.pick(f"key:{key_id}") for _ in range(20)}) == 1


def test_without_a_sticky_name_each_request_is_split_and_weight_0_gets_nothing() -> None:
    picks = Counter(SPLIT.pick() for _ in range(5000))
    assert abs(picks["chat-v2"] / 5000 - 0.10) < 0.02
    rolled_back = Alias("chat", (Target("chat-v1", 90), Target("chat-v2", 0)))
    assert {rolled_back.pick(f"user:{n}") for n in range(200)} == {"chat-v1"}
    assert Alias("none", (Target("chat-v1", 0),)).pick("key:1") is None


def test_the_catalog_round_trips_and_refuses_what_cannot_be_served() -> None:
    assert Catalog.from_json(CATALOG.to_json()) == CATALOG
    broken = Catalog.of([ModelEntry("a", "painter")], [Alias("a", (Target("b", 2000),))])
    problems = " ".join(broken.problems())
    for expected in ("kind", "has the name of a model", "no model 'b'", "weights are 0 to"):
        assert expected in problems
    with pytest.raises(ValueError, match="no model 'b'"):
        Catalog.from_json(broken.to_json())


def test_the_environment_lists_models_each_of_its_sampler_s_kind() -> None:
    listed = env_models("M", "hf", {"M": "chat=simulated, embed=simulated-embedder, big"})
    assert listed == [("chat", "simulated"), ("embed", "simulated-embedder"), ("big", "hf")]
    kinds = {name: entry.kind for name, entry in base_catalog(listed).models.items()}
    assert kinds == {"chat": GENERATOR, "embed": EMBEDDER, "big": GENERATOR}
    assert env_models("M", "hf", {}) == []
    for bad in ("a b=hf", "a,a", "=hf"):
        with pytest.raises(ImproperlyConfigured, match="M"):
            env_models("M", "hf", {"M": bad})


def test_the_watcher_puts_the_published_catalog_over_the_environment_s(
    redis_client: redis.Redis,
) -> None:
    key = f"test:catalog:{uuid.uuid4().hex}"
    base = base_catalog([("chat-v1", "simulated"), ("local", "simulated")])
    watcher = CatalogWatcher(redis_client, base, key=key)
    try:
        assert not watcher.refresh()
        assert watcher.current == base
        assert publish(redis_client, CATALOG, key=key)
        assert watcher.refresh()
        assert set(watcher.current.models) == {"chat-v1", "chat-v2", "embed", "local"}
        assert watcher.current.aliases["chat"] == SPLIT
        # An older snapshot (a publisher that read the database before a change) is refused.
        older = Catalog.of([ModelEntry("chat-v1")], version=6)
        assert not publish(redis_client, older, key=key)
        redis_client.set(key, "{not json")
        assert not watcher.refresh()  # the last good catalog stays
        assert "embed" in watcher.current.models
        redis_client.delete(key)
        assert watcher.refresh()
        assert watcher.current == base
    finally:
        redis_client.delete(key)


def test_an_offline_job_s_price_is_the_price_times_the_factor_rounded_down() -> None:
    entry = ModelEntry("m", prompt_price="1.5", completion_price="0.000003",
                       batch_price_factor="0.5")  # fmt: skip
    assert (entry.price.prompt_nanos, entry.price.completion_nanos) == (1_500_000, 3)
    # 3 billionths a token at half: 1.5, charged 1 (never more than the factor says).
    assert (entry.batch_price.prompt_nanos, entry.batch_price.completion_nanos) == (750_000, 1)
    assert ModelEntry("m").batch_price_factor == DEFAULT_BATCH_PRICE_FACTOR


def test_a_catalog_without_batch_factors_reads_with_the_default_and_a_bad_one_is_refused() -> None:
    older = (
        '{"version": 1, "aliases": [], "models": [{"name": "m", "kind": "generator", '
        '"description": "", "prompt_price": "1", "completion_price": "1", "created": 0}]}'
    )
    assert Catalog.from_json(older).models["m"].batch_price_factor == DEFAULT_BATCH_PRICE_FACTOR
    assert Catalog.from_json(Catalog.of([ModelEntry("m")]).to_json()).models["m"] == ModelEntry("m")
    with pytest.raises(ValueError, match="batch price factor"):
        Catalog.from_json(Catalog.of([ModelEntry("m", batch_price_factor="1.5")]).to_json())
