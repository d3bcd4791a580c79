"""The names existing installations hold (batching.installed_names), pinned against a recorded
list: the Celery task names, the Django app labels, every Redis key the key builder makes and
every metric name. A rename fails here. If it is meant, it needs a migration for running
installations first; then record the list again:

    .venv/bin/python -m tests.unit.test_installed_names > tests/unit/installed_names.txt
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from django.apps import apps

from batching import installed_names, keys
from tests.support.python_source import parse as parse_source

ROOT = Path(__file__).resolve().parents[2]
RECORDED = Path(__file__).with_name("installed_names.txt")
CODE = (
    "batching",
    "accounts",
    "telemetry",
    "serving",
    "workers",
    "operations",
    "offline",
    "planning",
    "inference_site",
)
METRIC_TYPES = {"Counter", "Gauge", "Histogram", "Summary", "GaugeMetricFamily",
                "CounterMetricFamily", "HistogramMetricFamily"}  # fmt: skip
# Arguments for the key builders' methods, by the parameter's annotation.
SAMPLE_ARGUMENTS = {"str": "x", "int": 1}


def task_names() -> Iterator[str]:
    from inference_site.celery import app
    from workers import tasks  # noqa: F401  # registers the worker's tasks

    yield from sorted(name for name in app.tasks if not name.startswith("celery."))


def app_labels() -> Iterator[str]:
    yield from sorted(f"{config.name} {config.label}" for config in apps.get_app_configs()
                      if config.name.split(".")[0] in CODE)  # fmt: skip


def built_keys(builder: Any) -> Iterator[str]:
    """Every key `builder` makes: its fields and properties, and its methods called with
    sample arguments."""
    names = [field.name for field in dataclasses.fields(builder)]
    names += [name for name, _ in inspect.getmembers(type(builder)) if not name.startswith("_")]
    for name in dict.fromkeys(names):
        value = getattr(builder, name)
        if callable(value):
            parameters = inspect.signature(value).parameters.values()
            if any(p.annotation not in SAMPLE_ARGUMENTS for p in parameters):
                continue
            value = value(*(SAMPLE_ARGUMENTS[p.annotation] for p in parameters))
        if isinstance(value, str):
            yield f"{type(builder).__name__}.{name} {value}"


def redis_keys() -> Iterator[str]:
    shard = keys.ShardKeys("x")
    for builder in (keys.QueueKeys("x"), keys.AccessKeys(), shard, keys.LaneKeys.of(shard, 1)):
        yield from built_keys(builder)
    for name, value in sorted(vars(keys).items()):
        if name.isupper() and isinstance(value, str):
            yield f"{name} {value}"
    yield f"results_channel {keys.results_channel('x')}"


def metric_names() -> Iterator[str]:
    """The first argument of every metric the code constructs."""
    found = set()
    for top in CODE:
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(parse_source(path.read_text())):
                if (
                    isinstance(node, ast.Call)
                    and getattr(node.func, "id", getattr(node.func, "attr", "")) in METRIC_TYPES
                    and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)
                ):
                    found.add(node.args[0].value)
    yield from sorted(found)


def current() -> list[str]:
    sections = {"task": task_names, "app": app_labels, "redis": redis_keys,
                "metric": metric_names}  # fmt: skip
    return [f"{kind} {line}" for kind, lines in sections.items() for line in lines()]


def test_the_names_installations_hold_are_the_recorded_ones() -> None:
    recorded = RECORDED.read_text().splitlines()
    now = current()
    assert set(now) == set(recorded), (
        f"gone or renamed: {sorted(set(recorded) - set(now))}; "
        f"new, not recorded: {sorted(set(now) - set(recorded))} (see this file's docstring)"
    )


def test_the_list_covers_each_kind_of_name() -> None:
    now = current()
    assert f"task {installed_names.RUN_BATCH_TASK}" in now
    assert f"app operations {installed_names.OPERATIONS_APP_LABEL}" in now
    assert "redis QueueKeys.policy sampling:{x}:policy" in now
    assert "redis ShardKeys.pending sampling:{x}:pending" in now
    metrics = [line for line in now if line.startswith("metric ")]
    assert len(metrics) > 15, metrics
    assert all(line.startswith(f"metric {installed_names.METRIC_PREFIX}") for line in metrics)


if __name__ == "__main__":
    import django

    sys.path.insert(0, str(ROOT))
    django.setup()
    print("\n".join(current()))
