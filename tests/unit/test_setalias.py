from __future__ import annotations

import pytest
from django.core.management.base import CommandError

from operations.management.commands.setalias import _target


def test_a_target_is_a_weight_a_canary_and_a_canarys_ramp() -> None:
    assert _target("v1=90") == ("v1", 90, False, 0)
    assert _target("v2=10:canary") == ("v2", 10, True, 0)
    assert _target("v2=10:canary:ramp=90") == ("v2", 10, True, 90)


@pytest.mark.parametrize(
    "text",
    ["v1", "=5", "v1=-1", "v1=ten", "v1=5:ramp=50", "v1=5:canary:ramp=", "v1=5:canary:ramp=x",
     "v1=5:canary:ramp=5:ramp=6", "v1=5:canary:slow", "v1=5:canary:ramp=1e3"],
)  # fmt: skip
def test_anything_else_is_refused_saying_the_forms(text: str) -> None:
    with pytest.raises(CommandError, match=r"MODEL=WEIGHT|only a canary ramps"):
        _target(text)
