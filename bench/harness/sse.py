"""The load generator's streaming client: one request whose answer is Server-Sent Events in
chunked transfer, read as it comes, each content chunk timed (bench.streaming).

Django-free and service-free: bytes of a request in, the stream's timeline out.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field


@dataclass
class Timeline:
    """What one stream delivered, and when (monotonic s): its status, each content chunk's
    text and arrival, and whether it ended with `data: [DONE]` (an error event does not)."""

    status: int = 0
    texts: list[str] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    done: bool = False
    error: str = ""

    @property
    def text(self) -> str:
        return "".join(self.texts)


def _content(event: bytes) -> tuple[str, bool, str]:
    """(its text, whether it is the last event, an error's message) of one `data:` event."""
    data = event.removeprefix(b"data: ").strip()
    if data == b"[DONE]":
        return "", True, ""
    parsed = json.loads(data)
    if "error" in parsed:
        return "", False, str(parsed["error"].get("message", ""))
    texts = [choice.get("text") or (choice.get("delta") or {}).get("content") or ""
             for choice in parsed.get("choices", [])]  # fmt: skip
    return "".join(texts), False, ""


async def stream(host: str, port: int, request: bytes) -> Timeline:
    """Send `request` on a connection of its own and read its streamed answer to the end."""
    timeline = Timeline()
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 16)
    try:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        timeline.status = int(head.split(b" ", 2)[1])
        if timeline.status != 200:
            return timeline
        pending = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            if size == 0:
                break
            pending += (await reader.readexactly(size + 2))[:-2]
            now = time.monotonic()
            *events, pending = pending.split(b"\n\n")
            for event in events:
                text, last, error = _content(event)
                if text:
                    timeline.texts.append(text)
                    timeline.arrivals.append(now)
                timeline.done = timeline.done or last
                timeline.error = timeline.error or error
    finally:
        writer.close()
    return timeline
