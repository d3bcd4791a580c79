"""What inference_site.direct re-implements of Django's handler for the generating paths, held
to what Django's own stack does: a host outside ALLOWED_HOSTS gets 400, the security headers
of SecurityMiddleware and XFrameOptionsMiddleware are on every answer, and an exception is a
500 logged on django.request with its traceback. Through gunicorn: tests/integration/
test_service.py."""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.core import signals
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from django.http import HttpRequest, HttpResponse

from inference_site.direct import DIRECT_PATHS, DirectRoutes

SECURITY_HEADERS = (
    "X-Content-Type-Options",
    "Referrer-Policy",
    "Cross-Origin-Opener-Policy",
    "X-Frame-Options",
)


class Answer:
    def __init__(self, routes: DirectRoutes, environ: dict[str, Any]) -> None:
        self.status = ""
        self.headers: dict[str, str] = {}
        self.body = b"".join(routes(environ, self._start))

    def _start(self, status: str, headers: list[tuple[str, str]]) -> None:
        self.status = status
        self.headers = dict(headers)

    @property
    def code(self) -> int:
        return int(self.status.split()[0])


def environ(path: str, host: str = "localhost", method: str = "GET") -> dict[str, Any]:
    return {
        "REQUEST_METHOD": method,
        "PATH_INFO": path,
        "SERVER_NAME": "localhost",
        "SERVER_PORT": "8000",
        "HTTP_HOST": host,
        "wsgi.input": io.BytesIO(b""),
        "wsgi.url_scheme": "http",
        "wsgi.errors": io.StringIO(),
    }


@pytest.fixture
def routes() -> Iterator[DirectRoutes]:
    # As Django's test Client does: the requests leave the test's database connection alone
    # (they touch no database; closing a connection another test opened is not theirs to do).
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    yield DirectRoutes(get_wsgi_application())
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)


def with_view(routes: DirectRoutes, view: Callable[[HttpRequest], HttpResponse]) -> None:
    """Every direct path served by `view` (the real views need a live Redis)."""
    for path in DIRECT_PATHS:
        routes.routes[path] = (view, "test-view")


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def django_request_log() -> Iterator[list[logging.LogRecord]]:
    """What django.request logs (Django's handler logs a 500 there, with its traceback)."""
    kept = Kept()
    logger = logging.getLogger("django.request")
    logger.addHandler(kept)
    yield kept.records
    logger.removeHandler(kept)


def test_every_direct_path_is_one_of_the_api_views(routes: DirectRoutes) -> None:
    assert set(routes.routes) == set(DIRECT_PATHS)
    assert all(getattr(view, "csrf_exempt", False) for view, _ in routes.routes.values())


def test_a_host_outside_allowed_hosts_gets_400_as_from_django(
    routes: DirectRoutes, django_request_log: list[logging.LogRecord]
) -> None:
    served: list[HttpRequest] = []

    def view(request: HttpRequest) -> HttpResponse:
        served.append(request)
        return HttpResponse("ok")

    with_view(routes, view)
    direct = Answer(routes, environ("/sample", host="evil.example", method="POST"))
    through_django = Answer(routes, environ("/healthz", host="evil.example"))
    assert direct.code == through_django.code == 400
    assert served == []  # the view never ran


def test_the_security_headers_are_the_ones_djangos_middleware_adds(routes: DirectRoutes) -> None:
    with_view(routes, lambda request: HttpResponse("ok"))
    direct = Answer(routes, environ("/v1/completions", method="POST"))
    through_django = Answer(routes, environ("/healthz"))
    assert (direct.code, direct.body) == (200, b"ok")
    for name in SECURITY_HEADERS:
        assert direct.headers.get(name) == through_django.headers.get(name), name
        assert direct.headers.get(name), name
    assert direct.headers["Content-Length"] == "2"


def test_an_exception_is_a_500_logged_on_django_request(
    routes: DirectRoutes, django_request_log: list[logging.LogRecord]
) -> None:
    def broken(request: HttpRequest) -> HttpResponse:
        raise RuntimeError("a bug in a view")

    with_view(routes, broken)
    answer = Answer(routes, environ("/api/inference", method="POST"))
    assert answer.code == 500
    assert answer.headers.get("X-Frame-Options")  # an error page is framed no more than others
    (record,) = [r for r in django_request_log if r.levelno == logging.ERROR]
    assert record.exc_info is not None
    assert isinstance(record.exc_info[1], RuntimeError)
    assert "/api/inference" in record.getMessage()
