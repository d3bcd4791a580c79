"""Settings that must refuse to start: a process without a signing key, through manage.py as an
operator runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from inference_site.lib.env import ImproperlyConfigured, env_secret
from inference_site.lib.stack import ROOT


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
    example = (ROOT / "deploy" / "env.example").read_text().splitlines()
    (line,) = [line for line in example if line.startswith("DJANGO_SECRET_KEY=")]
    assert line == "DJANGO_SECRET_KEY=", line
