"""`manage.py capacity` with a mix of models: each model's GPUs as the single-model plan of
its rate, deadline and call time; web nodes and Redis shards of the whole mix's rate."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from planning.mix import MixError, ModelLoad, read_mix


def capacity(*args: str) -> str:
    out = io.StringIO()
    call_command("capacity", *args, stdout=out)
    return out.getvalue()


def gpus_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.strip().startswith("GPUs needed"))


def test_a_mix_plans_each_model_as_alone_and_sums_the_gpus(tmp_path: Path) -> None:
    mix = tmp_path / "mix.txt"
    mix.write_text("# two models\nchat:2000:500\n\nembed:500:200:40  # fast calls\n")
    text = capacity("--mix", str(mix), "--model", "big:300:1000:250", "--seconds", "10")
    rows = {
        cells[1].strip(): cells for line in text.splitlines()
        if (cells := line.split("|")) and len(cells) > 8 and cells[1].strip() in
        ("chat", "embed", "big")
    }  # fmt: skip
    gpus = {name: int(cells[5]) for name, cells in rows.items()}
    for name, args in {
        "chat": ("--rps", "2000", "--deadline-ms", "500"),
        "embed": ("--rps", "500", "--deadline-ms", "200", "--batch-ms", "40"),
        "big": ("--rps", "300", "--deadline-ms", "1000", "--batch-ms", "250"),
    }.items():
        alone = capacity(*args, "--seconds", "10")
        assert gpus_line(alone).split()[-1] == str(gpus[name])
    assert f"GPUs in all:   {sum(gpus.values())}" in text
    assert "2,800 req/s in all" in text


def test_bad_mixes_are_refused_saying_why(tmp_path: Path) -> None:
    assert read_mix(["a:1:2"], None, 100.0) == [ModelLoad("a", 1.0, 2.0, 100.0)]
    for specs, reason in ((["a:1"], "NAME:RPS"), (["a:x:2"], "numbers"), (["a:0:2"], "above 0"),
                          (["a:1:2", "a:3:4"], "twice")):  # fmt: skip
        with pytest.raises(MixError, match=reason):
            read_mix(specs, None, 100.0)
    with pytest.raises(CommandError, match="or a mix"):
        capacity("--rps", "10", "--deadline-ms", "500", "--model", "a:1:500")
    with pytest.raises(CommandError, match="required"):
        capacity("--rps", "10")
    with pytest.raises(CommandError, match="No such file"):
        capacity("--mix", str(tmp_path / "absent.txt"))
