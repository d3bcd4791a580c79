"""Malformed HTTP requests, generated from a seed, and a raw-socket client that sends them.

Each case is the bytes a broken or hostile client writes on one connection, and how it
writes them: at once, then waits for the answer; or at once and half-closes (shutdown of its
writing side); or slowly, a few bytes at a time. The kinds cover what a server meets on an
open port: broken request lines and methods, huge headers, negative, huge and lying
Content-Length, broken chunked bodies, invalid UTF-8 and NUL bytes in the path, headers and
body, pipelined requests, HTTP/1.0, an HTTP/2 preface, absolute-form URIs.
"""

from __future__ import annotations

import random
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

AT_ONCE, HALF_CLOSE, SLOW = "at once", "half-close", "slow"
STATUS_LINE = re.compile(rb"HTTP/1\.[01] (\d{3}) ")
IDLE_AFTER_ANSWER_S = 0.5


@dataclass(frozen=True)
class Case:
    kind: str
    data: bytes
    how: str = AT_ONCE


@dataclass
class Outcome:
    case: Case
    statuses: list[int]  # every status line read back (several for pipelined requests)
    error: str = ""  # a connection error the client saw (reset: the server closed early)


def _junk(rng: random.Random, size: int) -> bytes:
    return bytes(rng.randrange(256) for _ in range(size))


def _request(method: str = "POST", target: str = "/sample", version: str = "HTTP/1.1",
             headers: list[tuple[str, str]] | None = None, body: bytes = b"",
             length: bool = True) -> bytes:  # fmt: skip
    lines = [f"{method} {target} {version}", "Host: 127.0.0.1"]
    if length:
        lines.append(f"Content-Length: {len(body)}")
    lines += [f"{name}: {value}" for name, value in headers or []]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape") + body


def _raw(parts: list[bytes]) -> bytes:
    return b"\r\n".join(parts) + b"\r\n\r\n"


def broken_request_line(rng: random.Random) -> bytes:
    choices = [
        b"GET",
        b"POST /sample",
        b"POST  /sample  HTTP/1.1",
        b"POST /sample HTTP/1.1 extra",
        b"post /sample HTTP/1.1",
        b"POST\t/sample\tHTTP/1.1",
        b"POST /sample HTTP/9.9",
        b"POST /sample HTTP/1.x",
        b"POST /sample HTTZ/1.1",
        b" POST /sample HTTP/1.1",
        b"POST /sample HTTP/1.1\rHost: x",
        b"POST " + b"/" * rng.randrange(5000, 20000) + b" HTTP/1.1",
        _junk(rng, rng.randrange(1, 200)),
    ]
    return _raw([rng.choice(choices), b"Host: 127.0.0.1", b"Content-Length: 2"]) + b"hi"


def broken_method(rng: random.Random) -> bytes:
    method = rng.choice(
        ["FOO", "G\x00T", "GE T", "P(ST", "X" * rng.randrange(30, 300), "CONNECT", "TRACE",
         "OPTIONS", "DELETE", "PATCH", "PUT", "HEAD", "\u00e9TE"]
    )  # fmt: skip
    return _request(method=method, body=b"a prompt")


def huge_headers(rng: random.Random) -> bytes:
    if rng.random() < 0.5:
        return _request(headers=[("X-Big", "a" * 65536)], body=b"a prompt")
    many = [(f"X-Many-{index}", "v" * rng.randrange(1, 200)) for index in range(300)]
    return _request(headers=many, body=b"a prompt")


def bad_content_length(rng: random.Random) -> tuple[bytes, str]:
    body = b"a prompt of some length"
    value = rng.choice(["-1", "-100", "99999999999999999999", "1e3", "0x10", " 5", "5, 6",
                        "abc", str(len(body) + 50), str(len(body) - 10), ""])  # fmt: skip
    data = _request(headers=[("Content-Length", value)], body=body, length=False)
    if rng.random() < 0.3:  # two of them, disagreeing
        data = _request(headers=[("Content-Length", "3"), ("Content-Length", "30")], body=body,
                        length=False)  # fmt: skip
    if rng.random() < 0.2:  # with a Transfer-Encoding too (request smuggling's opening move)
        data = _request(headers=[("Content-Length", "5"), ("Transfer-Encoding", "chunked")],
                        body=b"0\r\n\r\n", length=False)  # fmt: skip
    # A Content-Length larger than the body leaves the server waiting: half-close.
    return data, HALF_CLOSE


def broken_chunked(rng: random.Random) -> tuple[bytes, str]:
    body = rng.choice([
        b"zz\r\nhello\r\n0\r\n\r\n",
        b"5\r\nhello0\r\n\r\n",
        b"ffffffffffffffffffff\r\nhello\r\n0\r\n\r\n",
        b"5;" + b"x" * 9000 + b"\r\nhello\r\n0\r\n\r\n",
        b"5\r\nhel",
        b"-5\r\nhello\r\n0\r\n\r\n",
        b"5\nhello\n0\n\n",
        b"5\r\nhello\r\n0\r\nTrailer: \x00\r\n\r\n",
        b"3\r\nabc\r\n" * rng.randrange(1, 50) + b"0\r\n\r\n",
    ])  # fmt: skip
    coding = rng.choice(["chunked", "chunked, gzip", "gzip", "identity", "chunked, chunked",
                         "xchunked", " chunked"])  # fmt: skip
    data = _request(headers=[("Transfer-Encoding", coding)], body=body, length=False)
    return data, HALF_CLOSE


def bad_bytes(rng: random.Random) -> bytes:
    where = rng.choice(["path", "header", "body", "name"])
    bad = rng.choice([b"\xff\xfe", b"\x00", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"])
    if where == "path":
        line = b"POST /sam" + bad + b"ple HTTP/1.1"
        return _raw([line, b"Host: 127.0.0.1", b"Content-Length: 2"]) + b"hi"
    if where == "header":
        return _raw([b"POST /sample HTTP/1.1", b"Host: 127.0.0.1", b"X-Bad: a" + bad + b"b",
                     b"Content-Length: 2"]) + b"hi"  # fmt: skip
    if where == "name":
        return _raw([b"POST /sample HTTP/1.1", b"Host: 127.0.0.1", b"X" + bad + b": v",
                     b"Content-Length: 2"]) + b"hi"  # fmt: skip
    body = b"a prompt " + bad + b" end"
    return _request(body=body)


def pipelined(rng: random.Random) -> bytes:
    makers: list[Callable[[random.Random], bytes]] = [
        lambda r: _request(body=f"pipelined {r.random()}".encode()),
        lambda r: _request(method="GET", target="/healthz", length=False),
        broken_request_line,
        broken_method,
        bad_bytes,
    ]
    return b"".join(rng.choice(makers)(rng) for _ in range(rng.randrange(2, 6)))


def http_1_0(rng: random.Random) -> bytes:
    if rng.random() < 0.5:
        return _request(version="HTTP/1.0", body=f"an old client {rng.random()}".encode())
    return b"GET /healthz HTTP/1.0\r\n\r\n"


def http2_preface(rng: random.Random) -> bytes:
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    return preface + _junk(rng, rng.randrange(0, 64))


def absolute_form(rng: random.Random) -> bytes:
    target = rng.choice(["http://127.0.0.1/sample", "http://example.com/sample",
                         "https://evil.example/sample?x=1", "127.0.0.1:8000", "*",
                         "//sample", "http://[::1]/v1/completions"])  # fmt: skip
    return _request(target=target, body=b"absolute form")


GENERATORS: list[Callable[[random.Random], bytes | tuple[bytes, str]]] = [
    broken_request_line, broken_method, huge_headers, bad_content_length, broken_chunked,
    bad_bytes, pipelined, http_1_0, http2_preface, absolute_form,
]  # fmt: skip


def cases(count: int, seed: int) -> list[Case]:
    """`count` cases, every kind in turn, each drawn from `seed`; some half-close."""
    rng = random.Random(seed)
    made = []
    for index in range(count):
        generator = GENERATORS[index % len(GENERATORS)]
        drawn = generator(rng)
        data, how = drawn if isinstance(drawn, tuple) else (drawn, AT_ONCE)
        if how == AT_ONCE and rng.random() < 0.8:
            how = HALF_CLOSE  # the server closes once it has answered: no wait for silence
        made.append(Case(generator.__name__, data, how))
    return made


def slow_cases(count: int, seed: int) -> list[Case]:
    """Requests written a few bytes at a time (slowloris), some never finished."""
    rng = random.Random(seed)
    made = []
    for _ in range(count):
        data = _request(body=f"slowly {rng.random()}".encode())
        if rng.random() < 0.5:
            data = data[: rng.randrange(5, len(data) - 1)]  # stops writing mid-request
        made.append(Case("slow", data, SLOW))
    return made


def send(host: str, port: int, case: Case, timeout_s: float, slow_step_s: float = 0.2) -> Outcome:
    """Write the case on a new connection and read until the server closes it or `timeout_s`
    of silence: every status line read back."""
    received = b""
    error = ""
    with socket.create_connection((host, port), timeout=timeout_s) as connection:
        try:
            if case.how == SLOW:
                for start in range(0, len(case.data), 8):
                    connection.sendall(case.data[start : start + 8])
                    time.sleep(slow_step_s)  # duration: a slow client's pause
            else:
                connection.sendall(case.data)
            if case.how == HALF_CLOSE:
                connection.shutdown(socket.SHUT_WR)
            while True:
                chunk = connection.recv(65536)
                if not chunk:
                    break
                received += chunk
                # Answered, the connection kept alive: wait for more only while it keeps coming
                # (pipelined answers), not for the server's keep-alive timeout.
                connection.settimeout(IDLE_AFTER_ANSWER_S)
        except TimeoutError:
            if not received:
                error = "timeout"  # the server kept the connection open and silent
        except OSError as exc:  # reset or broken pipe: the server closed it early
            error = type(exc).__name__
    return Outcome(case, [int(status) for status in STATUS_LINE.findall(received)], error)
