"""Helpers shared by the tests: names, an HTTP client, an admin session, test samplers."""

from __future__ import annotations

import uuid

ADMIN_USER = "operator"
ADMIN_PASSWORD = "correct horse battery staple"


def unique_queue(label: str) -> str:
    """A queue of its own for a test: its Redis keys and Celery queue meet no other test's."""
    return f"t-{label}-{uuid.uuid4().hex[:8]}"
