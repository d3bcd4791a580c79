"""Typed readers for environment settings.

Every setting is read through one of these so that a bad value stops the process at start
with a message naming the variable, instead of failing later on a request.
"""

from __future__ import annotations

import math
import os
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

# Only the exception class: these helpers never touch Django's settings, so the launcher and
# the tooling can use them before (or without) configuring Django.
from django.core.exceptions import ImproperlyConfigured

N = TypeVar("N", int, float)

__all__ = [
    "ImproperlyConfigured",
    "env_bool",
    "env_choice",
    "env_float",
    "env_int",
    "env_list",
    "env_name",
    "env_secret",
    "env_secret_file",
    "env_str",
    "env_text",
    "with_password",
]


def env_str(name: str, default: str, environ: Mapping[str, str] | None = None) -> str:
    environ = os.environ if environ is None else environ
    value = environ.get(name, "")
    return value if value.strip() else default


def env_int(
    name: str,
    default: int,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    return _env_number(name, default, int, "an integer", minimum, maximum, environ)


def env_float(
    name: str,
    default: float,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    environ: Mapping[str, str] | None = None,
) -> float:
    return _env_number(name, default, float, "a number", minimum, maximum, environ)


def _env_number(
    name: str,
    default: N,
    parse: Callable[[str], N],
    kind: str,
    minimum: N | None,
    maximum: N | None,
    environ: Mapping[str, str] | None,
) -> N:
    raw = env_str(name, "", environ).strip()
    if not raw:
        value = default
    else:
        try:
            value = parse(raw)
        except ValueError:
            raise ImproperlyConfigured(f"{name} must be {kind}, got {raw!r}") from None
        if not math.isfinite(value):
            raise ImproperlyConfigured(f"{name} must be a finite number, got {raw!r}")
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ImproperlyConfigured(f"{name} must be at most {maximum}, got {value}")
    return value


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def env_text(name: str, default: str, environ: Mapping[str, str] | None = None) -> str:
    r"""A string kept exactly, spaces included, in which \n, \t, \r and \\ stand for a
    newline, a tab, a carriage return and a backslash: a stop string is often a newline, which
    an environment file cannot hold. A trailing lone backslash is kept as it is."""
    environ = os.environ if environ is None else environ
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    out: list[str] = []
    index = 0
    while index < len(raw):
        char = raw[index]
        if char == "\\" and index + 1 < len(raw):
            following = raw[index + 1]
            if following not in _ESCAPES:
                raise ImproperlyConfigured(
                    f"{name}: unknown escape \\{following} (use \\n, \\t, \\r or \\\\)"
                )
            out.append(_ESCAPES[following])
            index += 2
        else:
            out.append(char)
            index += 1
    return "".join(out)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_bool(name: str, default: bool, environ: Mapping[str, str] | None = None) -> bool:
    raw = env_str(name, "", environ).strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name} must be one of {sorted(_TRUE | _FALSE)}, got {raw!r}")


def env_choice(
    name: str, default: str, choices: tuple[str, ...], environ: Mapping[str, str] | None = None
) -> str:
    """One of `choices`, compared without case."""
    value = env_str(name, default, environ).strip().lower()
    if value not in choices:
        raise ImproperlyConfigured(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value


def env_list(name: str, default: list[str], environ: Mapping[str, str] | None = None) -> list[str]:
    raw = env_str(name, "", environ)
    if not raw.strip():
        return list(default)
    return [part.strip() for part in raw.split(",") if part.strip()]


NAME_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def is_name(value: str) -> bool:
    """1-64 letters, digits, '-', '_' or '.': a queue's (a model's) name."""
    return 0 < len(value) <= 64 and set(value) <= NAME_CHARACTERS


def env_name(name: str, default: str, environ: Mapping[str, str] | None = None) -> str:
    """A short identifier used in Redis keys and queue names: letters, digits, '-', '_', '.'."""
    value = env_str(name, default, environ).strip()
    if not is_name(value):
        raise ImproperlyConfigured(
            f"{name} must be 1-64 characters of letters, digits, '-', '_' or '.', got {value!r}"
        )
    return value


def env_models(
    name: str, default_sampler: str, environ: Mapping[str, str] | None = None
) -> list[tuple[str, str]]:
    """A list of models, each `name` or `name=sampler` (comma-separated; a name alone takes
    `default_sampler`): [(name, sampler)] in order, each name once; [] when unset."""
    models: list[tuple[str, str]] = []
    for entry in env_list(name, [], environ):
        model, _, sampler = entry.partition("=")
        model, sampler = model.strip(), sampler.strip() or default_sampler
        if not is_name(model):
            raise ImproperlyConfigured(
                f"{name}: each model is name or name=sampler, its name 1-64 characters of "
                f"letters, digits, '-', '_' or '.', got {entry!r}"
            )
        if any(model == seen for seen, _ in models):
            raise ImproperlyConfigured(f"{name} lists the model {model!r} twice")
        models.append((model, sampler))
    return models


def env_secret(name: str, fallback_file: Path, environ: Mapping[str, str] | None = None) -> str:
    """A secret with no default: the variable, else the first line of `fallback_file` (a file
    a developer's `make` writes once, git-ignored); else the process refuses to start."""
    value = env_str(name, "", environ).strip()
    if value:
        return value
    try:
        value = fallback_file.read_text().strip()
    except FileNotFoundError:
        value = ""
    except OSError as exc:
        raise ImproperlyConfigured(
            f"{name} is not set and {fallback_file} cannot be read: {exc}"
        ) from exc
    if not value:
        raise ImproperlyConfigured(
            f"{name} is not set: give it a long random value (for instance the output of "
            "`python -c 'import secrets; print(secrets.token_urlsafe(50))'`); "
            f"`make run` writes one to {fallback_file} for development"
        )
    return value


def env_secret_file(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The first line of the file the variable names (a Kubernetes or Docker secret mounted
    as a file), or "" when the variable is unset; a named file that cannot be read, or is
    empty, stops the process."""
    path = env_str(name, "", environ).strip()
    if not path:
        return ""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ImproperlyConfigured(f"{name}: cannot read {path}: {exc}") from exc
    value = lines[0].strip() if lines else ""
    if not value:
        raise ImproperlyConfigured(f"{name}: {path} is empty")
    return value


def with_password(url: str, password: str) -> str:
    """`url` with `password` in it, unless it has one of its own (or `password` is empty): a
    Redis URL from a ConfigMap and its password from a secret file. The password is
    percent-encoded, as redis-py and kombu decode it."""
    if not password:
        return url
    parts = urllib.parse.urlsplit(url)
    if parts.password:
        return url
    quoted = urllib.parse.quote(password, safe="")
    if not parts.netloc:  # unix:///path/redis.sock: the password goes in the query
        query = urllib.parse.parse_qs(parts.query)
        if "password" in query:
            return url
        return f"{url}{'&' if parts.query else '?'}password={quoted}"
    # The user as written (still percent-encoded, if it is), and the host.
    userinfo, _, host = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:{quoted}@{host}"))
