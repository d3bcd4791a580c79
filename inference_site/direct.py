"""The generating endpoints served straight to their views, past Django's middleware stack.

A /sample costs its web process about 0.6 ms of CPU at most if one node is to carry what one
GPU does (docs/reliability.md); Django's request machinery took ~0.4 ms of it: ten
middlewares (sessions, auth, CSRF, messages and the rest, which serve the admin), URL
resolution, and the request_started/finished signals (which close database connections the
request path never opens). The views of POST /sample, /v1/completions,
/v1/chat/completions and /api/inference need none of it: they read the body and headers,
authenticate by API key, and answer text or JSON.

So a WSGI app in front of Django's hands those paths to their views directly (found by
Django's own URL resolver at start, so urls.py stays the one list of routes) and everything
else to Django as before. What the skipped middlewares do that these answers still need is
done here: the host checked against ALLOWED_HOSTS (400 as Django says it), Content-Length
(CommonMiddleware's; a streaming answer goes chunked, as it comes), the security headers
SecurityMiddleware and XFrameOptionsMiddleware add, an exception answered as Django's handler
answers it (logged on django.request, 500), and django-prometheus' HTTP metrics counted as its
middlewares count them (inference_site.prometheus.record_direct).

It stays rather than Django's handler with a shorter middleware list for these paths, since
that would still pay the URL resolution and the request signals on every request. What it
re-implements is held to Django's own answers by tests/unit/test_direct.py (a bad Host, the
security headers, an exception's 500 and its log) and, through gunicorn, by
tests/integration/test_service.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from django.conf import settings
from django.core.handlers.exception import response_for_exception
from django.core.handlers.wsgi import WSGIRequest
from django.http import HttpResponse
from django.urls import resolve

from inference_site.prometheus import record_direct

# The views that need nothing of Django's middleware: every one is a csrf_exempt view of the
# API (serving.wrappers.counted), which reads no session, user or message.
DIRECT_PATHS = ("/sample", "/v1/completions", "/v1/chat/completions", "/api/inference")

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
View = Callable[[WSGIRequest], HttpResponse]


def security_headers() -> list[tuple[str, str]]:
    """The static headers SecurityMiddleware and XFrameOptionsMiddleware would add."""
    headers = []
    if settings.SECURE_CONTENT_TYPE_NOSNIFF:
        headers.append(("X-Content-Type-Options", "nosniff"))
    if settings.SECURE_REFERRER_POLICY:
        policy = settings.SECURE_REFERRER_POLICY
        value = policy if isinstance(policy, str) else ",".join(policy)
        headers.append(("Referrer-Policy", value))
    if settings.SECURE_CROSS_ORIGIN_OPENER_POLICY:
        headers.append(("Cross-Origin-Opener-Policy", settings.SECURE_CROSS_ORIGIN_OPENER_POLICY))
    headers.append(("X-Frame-Options", getattr(settings, "X_FRAME_OPTIONS", "DENY").upper()))
    return headers


class DirectRoutes:
    """WSGI: DIRECT_PATHS to their views, the rest to `django`."""

    def __init__(self, django: WSGIApp) -> None:
        self.django = django
        self.routes: dict[str, tuple[View, str]] = {}
        for path in DIRECT_PATHS:
            match = resolve(path)
            self.routes[path] = (match.func, match.view_name)
        self.headers = security_headers()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        route = self.routes.get(environ.get("PATH_INFO", ""))
        if route is None:
            return self.django(environ, start_response)
        started = time.perf_counter()
        view, view_name = route
        request = WSGIRequest(environ)
        try:
            request.get_host()  # DisallowedHost (a 400) for a host not in ALLOWED_HOSTS
            response = view(request)
        except Exception as exc:  # noqa: BLE001 - answered and logged as Django's handler does
            response = response_for_exception(request, exc)
        for name, value in self.headers:
            if name not in response:
                response[name] = value
        if response.streaming:  # written as it comes (chunked), and closed by the server
            record_direct(request.method or "", view_name, response.status_code, started)
            start_response(
                f"{response.status_code} {response.reason_phrase}", list(response.items())
            )
            return response
        content = response.content
        # As CommonMiddleware does: a length, not a chunked body, for the client's keep-alive.
        response["Content-Length"] = str(len(content))
        record_direct(request.method or "", view_name, response.status_code, started)
        start_response(f"{response.status_code} {response.reason_phrase}", list(response.items()))
        return [content]
