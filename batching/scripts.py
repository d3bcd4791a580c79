"""The Lua scripts of `batching/lua/`, as Redis runs them: one file a script, each with a
header naming its KEYS and ARGV, and the functions several scripts share in `common.lua`.

One templating mechanism: a line `-- #include common` takes in `common.lua` there, and a
marker `{{NAME}}` takes the value of the Python constant NAME from the mapping the caller
passes (the bound lives once, in Python: see batching.lanes.SCRIPT_CONSTANTS). A marker
without a value is an error at load time, never a script that fails in Redis.

Every script that reads the time takes an optional last argument, the time in ms: absent or
empty, the Redis node's TIME (production); set, that time (tests)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import redis

LUA_DIR = Path(__file__).with_name("lua")
INCLUDE = re.compile(r"^-- #include (\w+)$", re.MULTILINE)
CONSTANT = re.compile(r"\{\{(\w+)\}\}")


@cache
def _text(name: str) -> str:
    return (LUA_DIR / f"{name}.lua").read_text()


def source(name: str, constants: Mapping[str, object] | None = None) -> str:
    """The text Redis runs for script `name` (`batching/lua/<name>.lua`): its includes taken
    in and its constants' markers replaced by their values."""
    values = constants or {}

    def value(marker: re.Match[str]) -> str:
        if marker.group(1) not in values:
            raise ValueError(f"{name}.lua: no value for {marker.group(0)}")
        return str(values[marker.group(1)])

    text = INCLUDE.sub(lambda include: _text(include.group(1)), _text(name))
    return CONSTANT.sub(value, text)


def register(client: redis.Redis, name: str, constants: Mapping[str, object] | None = None) -> Any:
    """Script `name` registered with `client`: called, it runs by EVALSHA (loading itself on
    a NOSCRIPT)."""
    return client.register_script(source(name, constants))
