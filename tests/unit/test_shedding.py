"""The X-Request-Start parsing, the kernel's arrival time and the refusals of serving.shedding."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import gevent.event
import gevent.socket
import pytest

from serving.shedding import (
    CUT_SHARE,
    JOINED_AT,
    LEAST_IN_FLIGHT,
    MAX_HEADER_SKEW_S,
    MIN_WORK_MS,
    OWN_DELAY_SHARE,
    WORK_MIN_SAMPLES,
    WORK_REFRESH_S,
    WORK_WINDOW_S,
    QuickestAnswers,
    Shedder,
    ShedReason,
    header_start,
    socket_wait_s,
)

NOW = 1_795_000_000.25


@pytest.mark.parametrize(
    "value",
    [f"t={NOW}", f"{NOW}", f"t={NOW * 1000:.0f}", f"t={NOW * 1_000_000:.0f}", f"  t={NOW}  "],
)
def test_x_request_start_in_seconds_ms_or_us(value: str) -> None:
    assert header_start(value, NOW + 0.5) == pytest.approx(NOW, abs=0.001)


@pytest.mark.parametrize(
    "value",
    [None, "", "t=", "t=abc", "t=nan", "t=inf", f"t={NOW - MAX_HEADER_SKEW_S - 5}", "t=12345"],
)
def test_a_missing_malformed_or_implausible_x_request_start_is_ignored(value: str | None) -> None:
    assert header_start(value, NOW) is None


def test_arrival_counts_the_wait_the_header_shows() -> None:
    shedder = Shedder(max_in_flight=10)
    before = time.monotonic()
    arrival = shedder.arrival({"HTTP_X_REQUEST_START": f"t={time.time() - 0.3:.6f}"})
    assert before - 0.31 < arrival < before - 0.29
    assert shedder.arrival({}) >= before  # without it: now


def test_a_request_that_waited_its_deadline_or_one_too_many_is_refused() -> None:
    shedder = Shedder(max_in_flight=2)
    deadline_ms = 500
    now = time.monotonic()
    assert shedder.refusal(now, deadline_ms) is None
    almost = now - (deadline_ms - MIN_WORK_MS - 20) / 1000
    assert shedder.refusal(almost, deadline_ms) is None
    late = now - (deadline_ms - MIN_WORK_MS + 20) / 1000
    assert shedder.refusal(late, deadline_ms) == ShedReason.LATE
    shedder.in_flight = 2
    assert shedder.refusal(now, deadline_ms) == ShedReason.IN_FLIGHT


def test_late_answers_of_a_busy_process_cut_its_in_flight_limit_and_on_time_ones_restore_it() -> (
    None
):
    shedder = Shedder(max_in_flight=1000)
    now = time.monotonic() - 1  # arrived a second ago, never joined: all its time was here
    shedder.in_flight = 400
    shedder.timed_out(now, None, 500)
    shedder.adapt()
    assert shedder.limit == pytest.approx(400 * CUT_SHARE)
    assert shedder.refusal(time.monotonic(), 500) == ShedReason.IN_FLIGHT
    # A 504 of a request admitted before the cut says nothing of the limit since.
    shedder.timed_out(now, None, 500)
    shedder.adapt()
    assert shedder.limit > 400 * CUT_SHARE
    # Windows without one give the limit back, up to WEB_MAX_IN_FLIGHT.
    for _ in range(1000):
        shedder.adapt()
    assert shedder.limit == 1000
    shedder.in_flight = 0
    assert shedder.refusal(time.monotonic(), 500) is None


def test_a_504_of_a_process_that_holds_few_requests_cuts_nothing() -> None:
    shedder = Shedder(max_in_flight=1000)
    shedder.in_flight = LEAST_IN_FLIGHT - 1  # a stalled GPU's 504s, not this process's load
    shedder.timed_out(time.monotonic() - 1, None, 500)
    shedder.adapt()
    assert shedder.limit == 1000
    shedder.in_flight = LEAST_IN_FLIGHT
    for _ in range(50):  # a busy process's 504s, window after window: never under the least
        arrival = time.monotonic()  # after the last cut, and 60 ms here before it joined
        shedder.timed_out(arrival, arrival + 0.06, 500)
        shedder.adapt()
    assert shedder.limit == LEAST_IN_FLIGHT


@pytest.fixture(params=["stdlib", "gevent"])
def tcp_pair(request: pytest.FixtureRequest) -> Iterator[tuple[socket.socket, socket.socket]]:
    """A loopback TCP connection: (client, the server's end), the server's as gunicorn's
    gevent workers hold it or as a plain socket."""
    module = gevent.socket if request.param == "gevent" else socket
    with module.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with socket.create_connection(listener.getsockname()) as client:
            served, _ = listener.accept()
            with served:
                yield client, served


def test_without_a_header_arrival_is_when_the_kernel_got_the_bytes(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    client, served = tcp_pair
    client.sendall(b"POST /sample HTTP/1.1\r\nContent-Length: 1\r\n\r\nx")
    time.sleep(0.25)  # duration: the request waits unread, as in a saturated process's backlog
    shedder = Shedder(max_in_flight=10)
    before = time.monotonic()
    arrival = shedder.arrival({"gunicorn.socket": served})
    assert before - 0.3 < arrival < before - 0.2
    waited = socket_wait_s(served)
    assert waited is not None
    assert 0.2 < waited < 0.3
    # The header, when present, wins: it names the arrival at the node, before any hop.
    stamped = shedder.arrival(
        {"gunicorn.socket": served, "HTTP_X_REQUEST_START": f"t={time.time() - 0.1:.6f}"}
    )
    assert before - 0.11 < stamped < before - 0.09


def test_without_a_tcp_socket_arrival_is_now() -> None:
    left, right = socket.socketpair()  # a Unix socket: no TCP_INFO
    with left, right:
        assert socket_wait_s(right) is None
        before = time.monotonic()
        assert Shedder(max_in_flight=1).arrival({"gunicorn.socket": right}) >= before
    assert socket_wait_s(None) is None


def answered(quickest: QuickestAnswers, took_ms: float, count: int) -> None:
    for _ in range(count):
        quickest.record(took_ms / 1000)


def test_a_models_least_work_is_what_its_quickest_recent_answers_took() -> None:
    clock = [1000.0]
    quickest = QuickestAnswers(clock=lambda: clock[0])
    answered(quickest, 150, WORK_MIN_SAMPLES - 1)
    assert quickest.least_work_ms(500) == 0  # too few answers: not known
    answered(quickest, 150, 50)
    answered(quickest, 400, 50)
    clock[0] += WORK_REFRESH_S
    assert quickest.least_work_ms(500) == 150
    # Never over half the model's deadline.
    assert quickest.least_work_ms(200) == 100
    # Old answers are forgotten, and a cheaper spell shows at the next refresh.
    clock[0] += WORK_WINDOW_S + WORK_REFRESH_S
    answered(quickest, 90, WORK_MIN_SAMPLES)
    assert quickest.least_work_ms(500) == 90
    clock[0] += WORK_WINDOW_S + WORK_REFRESH_S
    assert quickest.least_work_ms(500) == 0
    # Answers alone keep no more than a window of them.
    for _ in range(30):
        clock[0] += WORK_WINDOW_S / 10
        answered(quickest, 100, 10)
    assert len(quickest._answers) <= 11 * 10


def test_a_504_of_a_request_that_joined_its_batch_at_once_cuts_nothing() -> None:
    """A slow GPU queue's 504: fewer requests in flight would not have made it on time."""
    deadline_ms = 500
    own_ms = OWN_DELAY_SHARE * deadline_ms
    shedder = Shedder(max_in_flight=1000)
    shedder.in_flight = 400
    arrival = time.monotonic() - deadline_ms / 1000
    shedder.timed_out(arrival, arrival + (own_ms - 5) / 1000, deadline_ms)
    shedder.adapt()
    assert shedder.limit == 1000
    # One that spent a tenth of its deadline here before it joined: this process is saturated.
    arrival = time.monotonic() - deadline_ms / 1000
    shedder.timed_out(arrival, arrival + (own_ms + 5) / 1000, deadline_ms)
    shedder.adapt()
    assert shedder.limit == pytest.approx(400 * CUT_SHARE)


def test_each_greenlet_sees_only_its_own_requests_join() -> None:
    """JOINED_AT is a context variable: gevent's greenlets (one per connection) keep their
    own, so one request's join never times another's."""

    first_set, second_set = gevent.event.Event(), gevent.event.Event()

    def first() -> float | None:
        JOINED_AT.set(1.0)
        first_set.set()
        second_set.wait()  # the other greenlet has set its own meanwhile
        return JOINED_AT.get()

    def second() -> float | None:
        first_set.wait()
        JOINED_AT.set(2.0)
        second_set.set()
        return JOINED_AT.get()

    greenlets = [gevent.spawn(first), gevent.spawn(second)]
    gevent.joinall(greenlets)
    first_value, second_value = (greenlet.value for greenlet in greenlets)
    assert (first_value, second_value) == (1.0, 2.0)
    assert JOINED_AT.get() is None
