"""A tiny HTTP client for the tests: one request, its status, headers, body and duration."""

from __future__ import annotations

import http.client
import time
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass
class Reply:
    status: int
    body: str
    headers: dict[str, str]
    seconds: float


def request(
    base_url: str,
    path: str,
    body: bytes | str | None = None,
    method: str = "POST",
    headers: dict[str, str] | None = None,
    timeout: float = 10.0,
) -> Reply:
    url = urlsplit(base_url)
    connection = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=timeout)
    payload = body.encode() if isinstance(body, str) else body
    try:
        started = time.perf_counter()
        connection.request(method, path, body=payload, headers=headers or {})
        response = connection.getresponse()
        data = response.read()
        elapsed = time.perf_counter() - started
        return Reply(
            response.status,
            data.decode("utf-8", "replace"),
            {k.lower(): v for k, v in response.getheaders()},
            elapsed,
        )
    finally:
        connection.close()


def sample(base_url: str, prompt: bytes | str, **kwargs: object) -> Reply:
    return request(base_url, "/sample", prompt, **kwargs)  # type: ignore[arg-type]
