from __future__ import annotations

import pytest

from config.env import (
    ImproperlyConfigured,
    env_bool,
    env_choice,
    env_float,
    env_int,
    env_list,
    env_name,
    env_str,
    env_text,
)
from devstack.stack import CPU_PROFILE, cpu_profile


def test_defaults_when_unset_or_blank() -> None:
    assert env_int("X", 7, environ={}) == 7
    assert env_int("X", 7, environ={"X": "  "}) == 7
    assert env_str("X", "d", environ={"X": ""}) == "d"
    assert env_bool("X", True, environ={}) is True
    assert env_list("X", ["a"], environ={}) == ["a"]


def test_values_are_parsed() -> None:
    assert env_int("X", 7, environ={"X": "42"}) == 42
    assert env_bool("X", False, environ={"X": "Yes"}) is True
    assert env_bool("X", True, environ={"X": "off"}) is False
    assert env_list("X", [], environ={"X": "a, b,,c"}) == ["a", "b", "c"]
    assert env_name("X", "q", environ={"X": "model-7b.v2"}) == "model-7b.v2"
    assert env_choice("X", "auto", ("auto", "on"), environ={"X": " ON "}) == "on"
    assert env_choice("X", "auto", ("auto", "on"), environ={}) == "auto"


@pytest.mark.parametrize(
    ("reader", "raw", "message"),
    [
        (lambda env: env_int("SAMPLING_MAX_BATCH_SIZE", 100, maximum=100, environ=env), "101",
         "SAMPLING_MAX_BATCH_SIZE must be at most 100"),
        (lambda env: env_int("SAMPLING_MAX_BATCH_SIZE", 100, minimum=1, environ=env), "0",
         "SAMPLING_MAX_BATCH_SIZE must be at least 1"),
        (lambda env: env_int("SAMPLING_MAX_BATCH_SIZE", 100, environ=env), "ten",
         "SAMPLING_MAX_BATCH_SIZE must be an integer"),
        (lambda env: env_bool("SAMPLING_MAX_BATCH_SIZE", True, environ=env), "maybe",
         "SAMPLING_MAX_BATCH_SIZE must be one of"),
        (lambda env: env_name("SAMPLING_MAX_BATCH_SIZE", "q", environ=env), "a b",
         "SAMPLING_MAX_BATCH_SIZE must be 1-64 characters"),
        (lambda env: env_float("SAMPLING_MAX_BATCH_SIZE", 1.0, environ=env), "hot",
         "SAMPLING_MAX_BATCH_SIZE must be a number"),
        (lambda env: env_float("SAMPLING_MAX_BATCH_SIZE", 1.0, environ=env), "nan",
         "SAMPLING_MAX_BATCH_SIZE must be a finite number"),
        (lambda env: env_float("SAMPLING_MAX_BATCH_SIZE", 1.0, maximum=1, environ=env), "1.5",
         "SAMPLING_MAX_BATCH_SIZE must be at most 1"),
        (lambda env: env_choice("SAMPLING_MAX_BATCH_SIZE", "a", ("a", "b"), environ=env), "c",
         "SAMPLING_MAX_BATCH_SIZE must be one of a, b; got 'c'"),
        (lambda env: env_text("SAMPLING_MAX_BATCH_SIZE", "", environ=env), "a\\q",
         r"SAMPLING_MAX_BATCH_SIZE: unknown escape \\q"),
    ],
)  # fmt: skip
def test_bad_values_name_the_variable(reader, raw: str, message: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=message):
        reader({"SAMPLING_MAX_BATCH_SIZE": raw})


def test_floats_and_escaped_text() -> None:
    assert env_float("X", 0.5, environ={}) == 0.5
    assert env_float("X", 0.5, environ={"X": " 0.9 "}) == 0.9
    assert env_text("X", "", environ={}) == ""
    assert env_text("X", "", environ={"X": "\\n"}) == "\n"
    assert env_text("X", "", environ={"X": " ###\\t\\\\n "}) == " ###\t\\n "
    assert env_text("X", "", environ={"X": "end\\"}) == "end\\"


def test_cpu_profile_fills_only_what_is_unset_and_only_for_a_model() -> None:
    assert cpu_profile({}) == CPU_PROFILE
    unset = {name: value for name, value in CPU_PROFILE.items() if name != "SAMPLING_DEADLINE_MS"}
    assert cpu_profile({"SAMPLER": "hf", "SAMPLING_DEADLINE_MS": "800"}) == unset
    assert cpu_profile({"SAMPLER": "simulated"}) == {}


def test_make_run_starts_a_worker_for_each_model_with_its_sampler() -> None:
    from devstack.stack import Stack

    models = {"SAMPLER": "simulated", "SAMPLING_MODELS": "chat, embed=simulated-embedder"}
    assert Stack(env=models, gpus=[None]).worker_plan() == [
        (None, ("chat", "simulated")), (None, ("embed", "simulated-embedder"))
    ]  # fmt: skip
    # GPUs are dealt to the models in turn, at least one worker per model.
    assert [plan[0] for plan in Stack(env=models, gpus=[0, 1, 2]).worker_plan()] == [0, 1, 2]
    served = [model for _, model in Stack(env=models, gpus=[0, 1, 2]).worker_plan()]
    assert [model[0] if model else None for model in served] == ["chat", "embed", "chat"]
    assert Stack(env={"SAMPLING_MODELS": ""}, gpus=[0, 1]).worker_plan() == [(0, None), (1, None)]
