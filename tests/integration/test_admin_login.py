"""Admin login throttling (django-axes) through a real gunicorn: failed logins of one username
from one client address lock that pair out with a 429, the right password included; another
address (as the proxy reports it in X-Forwarded-For) and another username are not locked."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable

import pytest
from django.conf import settings

from devstack.stack import ROOT, Stack
from tests.support import ADMIN_PASSWORD, ADMIN_USER
from tests.support.admin_client import AdminSession

pytestmark = pytest.mark.integration

LOGIN = "/admin/login/?next=/admin/"


def attempt(stack: Stack, username: str, password: str, client_address: str) -> int:
    session = AdminSession(stack.base_url, headers={"X-Forwarded-For": client_address})
    status, url, _ = session.post_form(LOGIN, {"username": username, "password": password})
    if status == 200 and url == stack.base_url + "/admin/":
        return 302  # logged in: redirected to the index
    return status


def test_failed_logins_lock_out_the_username_from_that_address(
    start_stack: Callable[..., Stack], database_url: str
) -> None:
    stack = start_stack("axes", env={"SAMPLER": "simulated", "WEB_PROXY_COUNT": "1"})
    username, password = f"operator-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "createsuperuser", "--noinput",
         "--username", username, "--email", "o@example.com"],
        env={**os.environ, "DATABASE_URL": database_url, "DJANGO_SUPERUSER_PASSWORD": password},
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    guesser, elsewhere = "203.0.113.7", "198.51.100.9"
    assert attempt(stack, username, password, guesser) == 302  # the account works
    limit = settings.AXES_FAILURE_LIMIT
    for _ in range(limit - 1):
        assert attempt(stack, username, "wrong", guesser) == 200  # the form, with an error
    assert attempt(stack, username, "wrong", guesser) == 429  # the limit-th failure
    # Locked out: the right password from that address too.
    assert attempt(stack, username, password, guesser) == 429
    # Only that pair: the same user from another address, another user from that address.
    assert attempt(stack, username, password, elsewhere) == 302
    assert attempt(stack, ADMIN_USER, ADMIN_PASSWORD, guesser) == 302
