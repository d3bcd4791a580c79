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
from config.env import ImproperlyConfigured, env_models

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


def _moves(before: Alias, after: Alias, keys: int = 5000) -> Counter[tuple[str, str]]:
    """How many of `keys` API keys each change of split moves, by (from, to)."""
    moved: Counter[tuple[str, str]] = Counter()
    for key_id in range(keys):
        old, new = before.pick(f"key:{key_id}"), after.pick(f"key:{key_id}")
        assert old is not None
        assert new is not None
        if old != new:
            moved[(old, new)] += 1
    return moved


def test_raising_a_canarys_weight_moves_only_the_users_it_needs_to_the_canary() -> None:
    """90/10 to 90/20: the canary's share goes from 10% to 18.2%, so about 8% of the users
    move, every one of them from the baseline to the canary."""
    raised = Alias("chat", (Target("chat-v1", 90), Target("chat-v2", 20, canary=True)))
    moved = _moves(SPLIT, raised)
    assert set(moved) == {("chat-v1", "chat-v2")}
    assert 0.06 * 5000 <= moved.total() <= 0.10 * 5000


def test_shifting_weight_between_two_targets_moves_the_shifted_share() -> None:
    shifted = Alias("chat", (Target("chat-v1", 80), Target("chat-v2", 20, canary=True)))
    moved = _moves(SPLIT, shifted)
    assert set(moved) == {("chat-v1", "chat-v2")}
    assert 0.09 * 5000 <= moved.total() <= 0.12 * 5000


def test_removing_or_zeroing_one_of_three_targets_moves_only_its_users() -> None:
    three = Alias("chat", (Target("a", 50), Target("b", 30), Target("c", 20)))
    for gone in (
        Alias("chat", (Target("a", 50), Target("c", 20))),
        Alias("chat", (Target("a", 50), Target("b", 0), Target("c", 20))),
    ):
        moved = _moves(three, gone)
        assert moved
        assert {source for source, _ in moved} == {"b"}
        # Its users spread over the others by their weights (a 5:2 split of about 1,500).
        assert moved[("b", "a")] > moved[("b", "c")] > 0


def test_each_target_of_a_sticky_split_gets_its_weights_share() -> None:
    three = Alias("chat", (Target("a", 50), Target("b", 30), Target("c", 20)))
    picks = Counter(three.pick(f"user:{n}") for n in range(20_000))
    for model, share in (("a", 0.5), ("b", 0.3), ("c", 0.2)):
        assert abs(picks[model] / 20_000 - share) < 0.015


def test_failover_sends_only_an_unusable_targets_users_elsewhere_and_back() -> None:
    alias = Alias("fo", (Target("a", 60), Target("b", 30), Target("c", 10, canary=True)))
    keys = [f"key:{i}" for i in range(3000)]
    before = {key: alias.pick(key) for key in keys}
    during = {key: alias.pick(key, usable=lambda model: model != "c") for key in keys}
    moved = {key for key in keys if before[key] != during[key]}
    assert moved == {key for key in keys if before[key] == "c"}
    assert {during[key] for key in moved} == {"a", "b"}
    assert {key: alias.pick(key, usable=lambda model: True) for key in keys} == before
    # Nothing usable: the split as without failover (the refusal counts on the chosen target).
    assert {key: alias.pick(key, usable=lambda model: False) for key in keys} == before
    anonymous = Counter(alias.pick("", usable=lambda model: model != "c") for _ in range(2000))
    assert set(anonymous) == {"a", "b"}
