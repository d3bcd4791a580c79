"""Shedding at the front end: a request's deadline counts from when it reached the node, and a
process that cannot start a request's work in time refuses it at once, before any Redis call.

- Arrival: `X-Request-Start` when a proxy or load balancer set it (`t=<epoch>` in seconds, ms
  or us: nginx's `t=${msec}`, Heroku's ms), the time the request reached the node; otherwise,
  on Linux over TCP, when the request's last bytes reached this node's kernel (TCP_INFO's
  `tcpi_last_data_recv`: it counts the wait in the listen backlog and in the gevent hub
  before the view, which no code in the process sees); otherwise when the view starts. From
  it the deadline counts: `submit` gets what is left, and admission refuses a request whose
  predicted wait exceeds that, mostly without a Redis call.
- A request that has already waited its deadline less the least work a request needs is
  refused. That least work follows what this process serves: the quickest of its recent
  answers (WORK_QUANTILE of the 200s of the last WORK_WINDOWS windows, from the view's start),
  never under MIN_WORK_MS nor over half the deadline. A request with less time left than the
  quickest recent answer took would be answered 504 later: a call on the GPU, a saturated
  event loop, cannot take less. With too few recent answers it is MIN_WORK_MS.
- A process holds at most WEB_MAX_IN_FLIGHT generating requests (docs/reliability.md: the
  sizing rule); one more is refused.
- It holds fewer while it answers requests late. A request answered 504 (a stream's excepted:
  its length is its own) was admitted by a process that could not finish it in time: its CPU
  saturated, Redis slow to answer it, or its GPUs short or stalled.
  Each ADAPT_WINDOW_S with a 504 while it holds LEAST_IN_FLIGHT requests or more cuts the
  in-flight limit to CUT_SHARE of what it holds (no lower than that); a 504 of a request that
  came before the last cut does not count; each window without one gives GROWTH_SHARE and
  one request back.
  The limit so settles where admitted requests end in time, on a slow machine as on a fast
  one, and a process that answers on time never refuses for it (TCP's congestion window,
  its 504s the losses). With WEB_MAX_IN_FLIGHT under LEAST_IN_FLIGHT it never moves.

Refusals are 503 + Retry-After, worded by each endpoint, counted as `rejected`, and by reason
in `sampling_shed_requests_total`.

Tried and left out (docs/benchmarks/overload.md): estimating the wait before the view from
the gevent loop's lag, refusing a share of requests that follows the loop's standing lag (as
CoDel follows a queue's), and an in-flight limit driven by that lag. Each refused requests
that the code without them served on time, or kept too few.
"""

from __future__ import annotations

import math
import socket
import struct
import time
from collections import deque
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

# A request needs at least this much of its deadline left to be worth starting: one Redis
# round trip, its task's publish and a turn of the GPU cannot take less.
MIN_WORK_MS = 50
# The least work follows the quickest recent answers: this quantile of the 200s of the last
# WORK_WINDOWS adapt windows, once there are WORK_MIN_SAMPLES of them.
WORK_QUANTILE = 0.05
WORK_WINDOWS = 10
WORK_MIN_SAMPLES = 20
# The in-flight limit's control: a window with a 504 cuts it to CUT_SHARE of what the process
# holds, a window without one adds GROWTH_SHARE of it and one (a second: about +10% and 10).
ADAPT_WINDOW_S = 0.1
CUT_SHARE = 0.7
GROWTH_SHARE = 0.01
# Under this many in flight a 504 says little of this process's load: no cut, and none below.
LEAST_IN_FLIGHT = 64
# X-Request-Start values further from this process's clock than this are ignored (a clock
# set wrong, a header of another hop): the request counts from its view, as without one.
MAX_HEADER_SKEW_S = 60.0


# struct tcp_info (linux/tcp.h): 8 bytes of u8 fields and 9 u32 before `tcpi_last_data_recv`,
# the milliseconds since the connection last received data. Stable kernel ABI since 2.6.
_TCP_INFO = getattr(socket, "TCP_INFO", None)
_LAST_DATA_RECV = struct.Struct("=I")
_LAST_DATA_RECV_OFFSET = 52
_TCP_INFO_BYTES = 104
# The kernel counts that time in ticks (1 to 10 ms: HZ 1000 to 100), so a reading may be up
# to a tick over the truth; less the coarsest tick, a request's wait is never overstated: it
# is not refused or timed out early, at the price of counting up to 10 ms of a wait short.
KERNEL_TICK_MS = 10


class ShedReason(StrEnum):
    """The `reason` label of sampling_shed_requests_total."""

    LATE = "late"  # waited too much of its deadline before its view ran
    IN_FLIGHT = "in_flight"  # the process holds its in-flight limit already


def header_start(value: str | None, now_wall: float) -> float | None:
    """The wall-clock time (s) an `X-Request-Start` value names: `t=1700000000.123` (nginx's
    `t=${msec}`), `t=1700000000123` (ms) or `t=1700000000123456` (us), with or without `t=`;
    None for a missing, malformed or implausible one (over MAX_HEADER_SKEW_S from now)."""
    if not value:
        return None
    text = value.strip()
    if text.startswith("t="):
        text = text[2:]
    try:
        number = float(text)
    except ValueError:
        return None
    if not math.isfinite(number):
        return None
    # Seconds since 1970 are ~1.7e9 today: ms are ~1.7e12, us ~1.7e15.
    for scale in (1.0, 1e3, 1e6):
        seconds = number / scale
        if abs(seconds - now_wall) <= MAX_HEADER_SKEW_S:
            return seconds
    return None


def socket_wait_s(connection: Any) -> float | None:
    """How long ago (s) the kernel last received data on `connection` (a request's socket, as
    gunicorn puts it in `gunicorn.socket`): for a request read and handed to its view, how long
    it waited since its last bytes arrived, never more (KERNEL_TICK_MS). None off Linux, on a
    Unix socket, or without one."""
    if _TCP_INFO is None or connection is None:
        return None
    try:
        info = connection.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCP_INFO_BYTES)
    except (OSError, AttributeError, TypeError):
        return None
    if len(info) < _LAST_DATA_RECV_OFFSET + _LAST_DATA_RECV.size:
        return None
    waited_ms = _LAST_DATA_RECV.unpack_from(info, _LAST_DATA_RECV_OFFSET)[0]
    return max(0, waited_ms - KERNEL_TICK_MS) / 1000


class Shedder:
    """One web process's arrival estimates, in-flight count and refusals."""

    def __init__(self, max_in_flight: int) -> None:
        self.max_in_flight = max_in_flight
        self.limit = float(max_in_flight)  # less while requests are answered late
        self.in_flight = 0
        self._late = 0  # requests answered 504 in this window
        self._cut_at = -math.inf  # monotonic: the last cut
        self.least_work_ms = float(MIN_WORK_MS)
        self._took: list[float] = []  # ms from view to answer of this window's 200s
        self._took_windows: deque[list[float]] = deque(maxlen=WORK_WINDOWS)

    def timed_out(self, arrival: float) -> None:
        """A request of this process that arrived at `arrival` was answered 504. One admitted
        before the last cut says nothing of the limit since (TCP: one cut a round trip)."""
        if arrival > self._cut_at:
            self._late += 1

    def served(self, started: float) -> None:
        """A request of this process whose view started at `started` was answered 200."""
        self._took.append((time.monotonic() - started) * 1000)

    def adapt(self) -> None:
        """Called every ADAPT_WINDOW_S: the in-flight limit follows this window's 504s, the
        least work the recent answers."""
        self._took_windows.append(self._took)
        self._took = []
        took = sorted(ms for window in self._took_windows for ms in window)
        if len(took) >= WORK_MIN_SAMPLES:
            quickest = took[int(len(took) * WORK_QUANTILE)]
            self.least_work_ms = max(float(MIN_WORK_MS), quickest)
        else:
            self.least_work_ms = float(MIN_WORK_MS)
        if self._late and self.in_flight >= LEAST_IN_FLIGHT:
            cut = max(LEAST_IN_FLIGHT, min(self.limit, self.in_flight) * CUT_SHARE)
            self.limit = min(self.limit, cut)
            self._cut_at = time.monotonic()
        else:
            self.limit = min(self.max_in_flight, self.limit * (1 + GROWTH_SHARE) + 1)
        self._late = 0

    def arrival(self, meta: Mapping[str, Any]) -> float:
        """The request's arrival, on this process's monotonic clock."""
        now = time.monotonic()
        stamp = meta.get("HTTP_X_REQUEST_START")
        if stamp:
            now_wall = time.time()
            started = header_start(stamp, now_wall)
            if started is not None:
                return now - max(0.0, now_wall - started)
        waited = socket_wait_s(meta.get("gunicorn.socket"))
        return now if waited is None else now - waited

    def refusal(self, arrival: float, deadline_ms: int) -> ShedReason | None:
        """Why a request that arrived at `arrival` must be refused now, if it must."""
        if self.in_flight >= self.limit:  # WEB_MAX_IN_FLIGHT at most
            return ShedReason.IN_FLIGHT
        waited_ms = (time.monotonic() - arrival) * 1000
        if waited_ms + min(self.least_work_ms, deadline_ms / 2) > deadline_ms:
            return ShedReason.LATE
        return None
