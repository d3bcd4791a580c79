"""The client's address for admin login throttling (django-axes' AXES_CLIENT_IP_CALLABLE).

Behind WEB_PROXY_COUNT proxies that each append the address they were connected from to
X-Forwarded-For, the client is that many entries from the end: entries further left were
written by the client itself and prove nothing. With no proxy configured, a header shorter
than the count, or an entry that is no IP address, the connection's address. gunicorn must
then be reachable only through those proxies (a private bind address, a NetworkPolicy):
a client that reaches it directly writes the header it likes.
"""

from __future__ import annotations

import ipaddress

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
    try:
        return str(ipaddress.ip_address(forwarded[-hops]))
    except ValueError:  # "1.2.3.4:5678", "unknown": not an address the database can store
        return peer
