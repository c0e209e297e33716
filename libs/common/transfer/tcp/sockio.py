"""Blocking socket I/O of the TCP transfer server, with deadlines a slow peer cannot stretch.

The server's threads use blocking sockets (no per-call poll: the hot path is one
`recv_into`). Deadlines come from the kernel: `set_tick` puts SO_RCVTIMEO/SO_SNDTIMEO on
the socket, so a call that cannot complete returns what it has (or EAGAIN) after one tick,
and the caller checks its deadline then. A peer that sends one byte per tick therefore
still runs into the deadline: it bounds the whole frame, not each call. A call that
completes at once (every legitimate frame on a healthy link) reads no clock.
"""

from __future__ import annotations

import math
import socket
import struct
import time
from typing import Any


class FrameTimeout(TimeoutError):
    """A frame (or the first one of a connection) did not arrive in time."""


def set_tick(sock: socket.socket, tick_s: float) -> None:
    """Make blocking recv/send calls on `sock` return after at most `tick_s`."""
    seconds = int(tick_s)
    timeval = struct.pack("@ll", seconds, int((tick_s - seconds) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def recv_exact(
    sock: socket.socket, view: memoryview, budget_s: float = math.inf, deadline: float = math.inf
) -> int:
    """Fill `view`; return the bytes received (fewer only on EOF).

    FrameTimeout when it is not full `budget_s` after the call began (counted from the
    first call that came back short, so within one tick of that) or at `deadline`
    (time.monotonic), whichever is first.
    """
    got, total = 0, view.nbytes
    while got < total:
        try:
            n = sock.recv_into(view[got:], total - got, socket.MSG_WAITALL)
        except BlockingIOError:  # a tick passed with nothing new
            n = -1
        if n == 0:
            break
        if n > 0:
            got += n
            if got == total:
                break
        now = time.monotonic()
        if deadline == math.inf or budget_s < math.inf:
            deadline = min(deadline, now + budget_s)
            budget_s = math.inf  # the budget is turned into a deadline once
        if now >= deadline:
            raise FrameTimeout(f"{got} of {total} bytes after the deadline")
    return got


def wait_readable(ready: Any, poll_s: float, deadline: float) -> bool:
    """Wait until `ready` (a select.poll's `poll`, the socket registered for POLLIN)
    reports something: first spin on poll(0) for `poll_s` (a peer's next small batch
    is then served without a scheduler wake-up), then sleep in poll until `deadline`
    (time.monotonic; inf: no limit). False when the deadline passed first.

    poll(0) answers "nothing yet" cheaper than a non-blocking recv that raises, and
    releases the GIL each time, so the spin does not hold the service's event loop for
    more than one syscall at a time. A shutdown of the socket (stop, unregister's cut,
    eviction) wakes the sleep.
    """
    if poll_s > 0:
        end = time.perf_counter() + poll_s
        while time.perf_counter() < end:
            if ready(0):
                return True
    if ready(0):
        return True
    while True:
        if deadline == math.inf:
            timeout_ms = -1
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            timeout_ms = max(1, math.ceil(left * 1000))
        if ready(timeout_ms):
            return True


def send_small(sock: socket.socket, data: bytes, budget_s: float) -> None:
    """`send_all` of one short buffer (an ACK): one `send` when the socket takes it whole,
    as it does unless the peer has stopped reading."""
    try:
        sent = sock.send(data)
    except BlockingIOError:
        sent = 0
    if sent != len(data):
        send_all(sock, [memoryview(data)[sent:]], budget_s)


def send_all(sock: socket.socket, buffers: list[Any], budget_s: float = math.inf) -> None:
    """sendmsg every buffer (blocking socket), resuming after partial sends;
    FrameTimeout when the peer has not taken them `budget_s` after the first short send
    (a peer that stops reading)."""
    views = [memoryview(b).cast("B") for b in buffers]
    deadline = math.inf
    while views:
        try:
            sent = sock.sendmsg(views[:1024])
        except BlockingIOError:  # a tick passed and the peer took nothing
            sent = 0
        while sent and views:
            if sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0
        if views:
            now = time.monotonic()
            if deadline == math.inf:
                deadline = now + budget_s
            elif now >= deadline:
                left = sum(v.nbytes for v in views)
                raise FrameTimeout(f"peer did not take {left} bytes in time")
