"""The client's address for admin login throttling (django-axes' AXES_CLIENT_IP_CALLABLE).

Behind WEB_PROXY_COUNT proxies that each append the address they were connected from to
X-Forwarded-For, the client is that many entries from the end: entries further left were
written by the client itself and prove nothing. With no proxy configured, or a header shorter
than the count (a request that reached gunicorn past the proxy), the connection's address.
"""

from __future__ import annotations

from django.conf import settings
from django.http import HttpRequest


def client_ip(request: HttpRequest) -> str:
    peer = str(request.META.get("REMOTE_ADDR", ""))
    hops = settings.WEB_PROXY_COUNT
    if hops <= 0:
        return peer
    forwarded = [
        part.strip()
        for part in str(request.META.get("HTTP_X_FORWARDED_FOR", "")).split(",")
        if part.strip()
    ]
    if len(forwarded) < hops:
        return peer
    return forwarded[-hops]
