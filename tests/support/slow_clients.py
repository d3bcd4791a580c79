"""The slow clients: connections that send a request's head a line at a time, never finishing
it, run in a process of their own (`python -m tests.support.slow_clients HOST PORT COUNT`)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from devstack.stack import ROOT

LINE_EVERY_S = 2.0
HEAD = b"POST /sample HTTP/1.1\r\nHost: localhost\r\nContent-Type: text/plain\r\n"


async def hold(host: str, port: int, count: int) -> None:
    """Keep `count` unfinished requests open; print how many are open once a second."""
    state = {"open": 0, "reopened": 0}

    async def one(index: int) -> None:
        await asyncio.sleep(index / 1500)  # 1,500 new connections a second: no SYN storm
        while True:
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except OSError:
                await asyncio.sleep(0.5)
                continue
            state["open"] += 1
            try:
                writer.write(HEAD)
                while True:
                    try:
                        # Anything read (a 408, say) or the end: the server let go of it.
                        await asyncio.wait_for(
                            reader.read(4096), LINE_EVERY_S * random.uniform(0.8, 1.2)
                        )
                        break
                    except TimeoutError:
                        writer.write(b"X-Slow: %d\r\n" % index)
                        await writer.drain()
            except OSError:
                pass
            finally:
                state["open"] -= 1
                state["reopened"] += 1
                writer.close()

    tasks = [asyncio.create_task(one(index)) for index in range(count)]
    while True:
        print(f"open {state['open']} reopened {state['reopened']}", flush=True)
        await asyncio.sleep(1.0)
    del tasks  # pragma: no cover - runs until killed


@dataclass
class SlowClients:
    """The slow connections, from a child process, while the `with` block runs."""

    host: str
    port: int
    count: int
    opened: int = 0  # the most connections seen open at once

    @contextlib.contextmanager
    def held(self, settle_s: float = 3.0) -> Iterator[SlowClients]:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.slow_clients", self.host, str(self.port),
             str(self.count)],
            stdout=subprocess.PIPE, text=True, cwd=ROOT,
        )  # fmt: skip
        assert process.stdout is not None
        stdout = process.stdout

        def read() -> None:
            for line in stdout:
                self.opened = max(self.opened, int(line.split()[1]))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            time.sleep(self.count / 1500 + settle_s)  # all of them opened, then held a while
            yield self
        finally:
            process.kill()
            process.wait()


if __name__ == "__main__":
    host, port, count = sys.argv[1:4]
    asyncio.run(hold(host, int(port), int(count)))
