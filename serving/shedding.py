"""Shedding at the front end: a request's deadline counts from when it reached the node, and a
process that cannot start a request's work in time refuses it at once, before any Redis call.

- Arrival: `X-Request-Start` when a proxy or load balancer set it (`t=<epoch>` in seconds, ms
  or us: nginx's `t=${msec}`, Heroku's ms), the time the request reached the node; otherwise,
  on Linux over TCP, when the request's last bytes reached this node's kernel (TCP_INFO's
  `tcpi_last_data_recv`: it counts the wait in the listen backlog and in the gevent hub
  before the view, which no code in the process sees); otherwise when the view starts. From
  it the deadline counts: `submit` gets what is left, and admission refuses a request whose
  predicted wait exceeds that, mostly without a Redis call.
- A request that has already waited its deadline less MIN_WORK_MS is refused.
- Once its model is known, a request whose deadline has less left than that model's least
  work is refused too (QuickestAnswers): what the quickest of the model's recent answers in
  this process took, from their view's start to their answer. Such a request would end 504:
  its call on the GPU and the process's own path take longer. A request the response cache
  may answer is never refused so.
- A process holds at most WEB_MAX_IN_FLIGHT generating requests (docs/reliability.md: the
  sizing rule); one more is refused.
- It holds fewer while it answers requests late. A request answered 504 (a stream's excepted:
  its length is its own) counts when it spent OWN_DELAY_SHARE of its deadline from its
  arrival until its batch had it: mostly waiting for its view, for the event loop or for a
  Redis connection, the signs of a saturated process (with `X-Request-Start`, a proxy's queue
  and a slow client's body count too). A 504 of a request that joined its batch at
  once comes from the GPUs' queue (short or stalled GPUs, a deadline that holds few calls),
  which fewer requests in flight would not shorten.
  Each ADAPT_WINDOW_S with a counted 504 while it holds LEAST_IN_FLIGHT requests or more cuts
  the in-flight limit to CUT_SHARE of what it holds (no lower than that); a 504 of a request
  that came before the last cut does not count; each window without one gives GROWTH_SHARE
  and one request back.
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

import heapq
import math
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from enum import StrEnum
from typing import Any

# A request needs at least this much of its deadline left to be worth starting: one Redis
# round trip, its task's publish and a turn of the GPU cannot take less.
MIN_WORK_MS = 50
# A model's least work (QuickestAnswers): this quantile of its answers of the last
# WORK_WINDOW_S, once there are WORK_MIN_SAMPLES of them, computed at most every WORK_REFRESH_S.
WORK_QUANTILE = 0.05
WORK_WINDOW_S = 1.0
WORK_MIN_SAMPLES = 20
WORK_REFRESH_S = 0.1
# The in-flight limit's control: a window with a 504 cuts it to CUT_SHARE of what the process
# holds, a window without one adds GROWTH_SHARE of it and one (a second: about +10% and 10).
ADAPT_WINDOW_S = 0.1
CUT_SHARE = 0.7
GROWTH_SHARE = 0.01
# Under this many in flight a 504 says little of this process's load: no cut, and none below.
LEAST_IN_FLIGHT = 64
# A 504 says this process is saturated when its request spent this share of its deadline here
# before it joined its batch (measured: under 30 ms of 500 when the GPUs' queue is the limit,
# over 100 ms when the web processes' CPU is).
OWN_DELAY_SHARE = 0.1
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


# When the request this greenlet serves joined its batch (monotonic; None: not yet). Each
# greenlet has its own value; a view sets None as it starts.
JOINED_AT: ContextVar[float | None] = ContextVar("joined_at", default=None)


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

    def timed_out(self, arrival: float, joined: float | None, deadline_ms: int) -> None:
        """A request of this process that arrived at `arrival` and joined its batch at
        `joined` (None: never) was answered 504. It counts when it spent OWN_DELAY_SHARE of
        its deadline here before it joined, and came after the last cut: one admitted before
        it says nothing of the limit since (TCP: one cut a round trip)."""
        own_s = (time.monotonic() if joined is None else joined) - arrival
        if arrival > self._cut_at and own_s * 1000 >= OWN_DELAY_SHARE * deadline_ms:
            self._late += 1

    def adapt(self) -> None:
        """Called every ADAPT_WINDOW_S: the in-flight limit follows this window's 504s."""
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
        if waited_ms + MIN_WORK_MS > deadline_ms:
            return ShedReason.LATE
        return None


class QuickestAnswers:
    """One model's recent answer times in this process, and the least work they show."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._answers: deque[tuple[float, float]] = deque()  # (when, ms it took), oldest first
        self._least_ms = 0.0
        self._computed_at = -WORK_REFRESH_S

    def record(self, took_s: float) -> None:
        """A request answered `took_s` after its view started."""
        now = self._clock()
        self._forget(now)
        self._answers.append((now, took_s * 1000))

    def least_work_ms(self, deadline_ms: int) -> float:
        """The least work a request needs now (0: not known), at most half `deadline_ms`."""
        now = self._clock()
        if now - self._computed_at >= WORK_REFRESH_S:
            self._computed_at = now
            self._forget(now)
            count = len(self._answers)
            if count < WORK_MIN_SAMPLES:
                self._least_ms = 0.0
            else:
                rank = int(count * WORK_QUANTILE) + 1
                self._least_ms = heapq.nsmallest(rank, (ms for _, ms in self._answers))[-1]
        return min(self._least_ms, deadline_ms / 2)

    def _forget(self, now: float) -> None:
        while self._answers and self._answers[0][0] < now - WORK_WINDOW_S:
            self._answers.popleft()
