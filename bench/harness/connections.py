"""The load generator's HTTP/1.1 client: keep-alive connections to one server, opened on
demand, and one request's exchange on them (bench.harness.loadgen)."""

from __future__ import annotations

import asyncio
import time

# An idle keep-alive connection is reused only this fresh: gunicorn closes one after 2 s
# (its keepalive), and a request written as the server closes it reads nothing back, a
# failure of the client's, not the service's (seen at 2 req/s).
REUSE_WITHIN_S = 1.0

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class Connections:
    """Idle keep-alive connections to one server, opened on demand."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[tuple[Connection, float]] = []  # with the time it became idle

    async def get(self) -> Connection:
        now = time.monotonic()
        while self.idle:
            connection, since = self.idle.pop()
            if now - since < REUSE_WITHIN_S:
                return connection
            connection[1].close()
        return await asyncio.open_connection(self.host, self.port, limit=1 << 16)

    def put(self, connection: Connection) -> None:
        self.idle.append((connection, time.monotonic()))

    def close(self) -> None:
        for (_, writer), _since in self.idle:
            writer.close()
        self.idle.clear()


async def exchange(connections: Connections, request: bytes) -> tuple[int, bytes]:
    reader, writer = await connections.get()
    try:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        length, keep_alive = 0, True
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection" and value.strip().lower() == b"close":
                keep_alive = False
        body = await reader.readexactly(length) if length else b""
    except BaseException:
        writer.close()
        raise
    if keep_alive:
        connections.put((reader, writer))
    else:
        writer.close()
    return status, body
