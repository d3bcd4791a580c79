"""Settings that must refuse to start: a process without a signing key, through manage.py as an
operator runs it."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest
import redis
import yaml

from config.env import ImproperlyConfigured, env_secret
from devstack.stack import ROOT


def manage_check(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "DJANGO_SECRET_KEY"}
    # As on a clean checkout: no key file where settings look for one.
    base["DJANGO_SECRET_KEY_FILE"] = str(tmp_path / "no-key-here")
    return subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "check"],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_manage_check_refuses_without_a_secret_key(tmp_path: Path) -> None:
    refused = manage_check(tmp_path)
    assert refused.returncode != 0
    assert "ImproperlyConfigured: DJANGO_SECRET_KEY is not set" in refused.stderr
    assert manage_check(tmp_path, DJANGO_SECRET_KEY="a" * 50).returncode == 0


def test_the_key_file_serves_when_the_variable_is_unset(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("from-the-file\n")
    assert env_secret("K", key_file, environ={}) == "from-the-file"
    assert env_secret("K", key_file, environ={"K": "from-the-variable"}) == "from-the-variable"
    key_file.write_text("")
    with pytest.raises(ImproperlyConfigured, match="K is not set"):
        env_secret("K", key_file, environ={})


def test_deployments_ship_no_known_key() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    key = compose["x-app"]["environment"]["DJANGO_SECRET_KEY"]
    assert key.startswith("${DJANGO_SECRET_KEY:?"), key  # compose refuses to start without it
    # The example names a file to hold the key, and holds no key itself.
    example = environment_file(ROOT / "deploy" / "env.example")
    assert "DJANGO_SECRET_KEY" not in example
    assert example["DJANGO_SECRET_KEY_FILE"].startswith("/")


def environment_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines as systemd's EnvironmentFile reads them (comments and blanks skipped,
    one pair of surrounding quotes dropped)."""
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        name, _, value = line.partition("=")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[name.strip()] = value
    return values


def check_deploy(tmp_path: Path, **overrides: str) -> subprocess.CompletedProcess[str]:
    """`manage.py check --deploy --fail-level WARNING` with deploy/env.example's values, its
    two machine paths (the key file, the database) made real under `tmp_path`."""
    key_file = tmp_path / "secret-key"
    key_file.write_text(secrets.token_urlsafe(50) + "\n")
    production = {
        **environment_file(ROOT / "deploy" / "env.example"),
        "DJANGO_SECRET_KEY_FILE": str(key_file),
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        **overrides,
    }
    assert "DJANGO_SECRET_KEY" not in production  # the example names a file, not a value
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "SAMPLING_"))}
    return subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "check", "--deploy", "--fail-level", "WARNING"],
        env={**inherited, **production},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_check_deploy_passes_with_the_production_example(tmp_path: Path) -> None:
    checked = check_deploy(tmp_path)
    assert checked.returncode == 0, checked.stderr + checked.stdout


def test_check_deploy_fails_without_https_behind_the_proxy(tmp_path: Path) -> None:
    """The check can fail: without DJANGO_HTTPS, the redirect, cookie and HSTS warnings."""
    checked = check_deploy(tmp_path, DJANGO_HTTPS="0")
    assert checked.returncode != 0
    for warning in ("security.W004", "security.W008", "security.W012", "security.W016"):
        assert warning in checked.stderr, checked.stderr


def test_redis_password_file_fills_every_redis_url(tmp_path: Path) -> None:
    password_file = tmp_path / "redis-password"
    password_file.write_text("s3cret/with@signs\n")
    shown = subprocess.run(
        [sys.executable, "-c",
         "import django; django.setup(); from django.conf import settings as s; "
         "print(s.REDIS_URL); print(s.SAMPLING_REDIS_URL); print(s.CELERY_BROKER_URL); "
         "print(s.CELERY_RESULT_BACKEND)"],
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "inference_site.settings",
             "DJANGO_SECRET_KEY": "k" * 50, "REDIS_PASSWORD_FILE": str(password_file),
             "REDIS_URL": "redis://redis.internal:6379/0",
             "SAMPLING_REDIS_URL": "redis://:own-password@other:6379/1"},
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    redis_url, sampling_url, broker_url, backend = shown.stdout.split()
    encoded = urllib.parse.quote("s3cret/with@signs", safe="")
    assert redis_url == f"redis://:{encoded}@redis.internal:6379/0"
    assert broker_url == redis_url
    assert sampling_url == "redis://:own-password@other:6379/1"  # its own password kept
    assert backend.endswith(sampling_url)
    # What a client makes of it: the password as written in the file.
    assert redis.connection.parse_url(redis_url)["password"] == "s3cret/with@signs"


def test_an_unreadable_secret_file_names_the_variable(tmp_path: Path) -> None:
    refused = manage_check(tmp_path, DJANGO_SECRET_KEY="a" * 50,
                           REDIS_PASSWORD_FILE=str(tmp_path / "missing"))  # fmt: skip
    assert refused.returncode != 0
    assert "REDIS_PASSWORD_FILE" in refused.stderr
