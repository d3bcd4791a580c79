"""A logged-in Django admin session over real HTTP (urllib with a cookie jar)."""

from __future__ import annotations

import http.cookiejar
import re
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence


class AdminSession:
    def __init__(self, base_url: str, headers: dict[str, str] | None = None) -> None:
        self.base_url = base_url
        self.cookies = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.cookies))
        # Sent with every request (X-Forwarded-For, as a proxy in front would add it).
        self.opener.addheaders = list((headers or {}).items())

    def get(self, path: str) -> tuple[int, str]:
        try:
            with self.opener.open(self.base_url + path, timeout=30) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def post_form(
        self, path: str, fields: Mapping[str, str | Sequence[str]]
    ) -> tuple[int, str, str]:
        """POST `fields` (a list: the field repeated, as several checked boxes) with the
        form's CSRF token; returns status, final URL and body."""
        _, page = self.get(path)
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
        assert token, f"no CSRF token on {path}"
        data = urllib.parse.urlencode(
            {"csrfmiddlewaretoken": token.group(1), **fields}, doseq=True
        ).encode()
        request = urllib.request.Request(
            self.base_url + path, data=data, headers={"Referer": self.base_url + path}
        )
        try:
            with self.opener.open(request, timeout=30) as response:
                return response.status, response.geturl(), response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, self.base_url + path, exc.read().decode()

    def login(self, username: str, password: str) -> None:
        status, url, _ = self.post_form(
            "/admin/login/?next=/admin/", {"username": username, "password": password}
        )
        assert (status, url) == (200, self.base_url + "/admin/"), "login failed"
