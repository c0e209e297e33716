"""Sending side of one TCP transport connection: batch parts onto the socket, in order.

    part >= thread_bytes ---------> [send lock] --> worker thread: blocking sendmsg
    smaller, nobody else sending --> sendmsg inline --all taken--> done
                                        | the socket buffer is full
                                        v
                                   [send lock] --> sendmsg on each writable event

Small parts cost one `sendmsg` and no lock, task or timeout object. A large part goes
whole to a worker thread: on loopback one non-blocking `sendmsg` from the loop pushes
a whole window (MBs), so the loop thread did every connection's kernel copy (and the
receiving TCP stack, which runs in the sender's context) one after the other on one
core; from threads, without the GIL, two connections use both cores (measured
faster on 64 x 1 MiB writes: docs/transfer.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from concurrent.futures import Executor
from typing import Any

from libs.common.transfer.tcp.frame import IOV_MAX


def advance(views: list[memoryview], start: int, sent: int) -> int:
    """Drop `sent` bytes from views[start:] (in place); return the new start index."""
    while sent:
        if sent >= views[start].nbytes:
            sent -= views[start].nbytes
            start += 1
        else:
            views[start] = views[start][sent:]
            sent = 0
    return start


class PartSender:
    """Writes parts' buffers (headers, payload memoryviews) to a non-blocking socket.

    Parts go out whole and in call order: a part that cannot go out at once takes the
    send lock, and later parts queue behind it. Raises on a dead socket; the caller
    then drops the connection (a half-sent part leaves the stream out of sync).
    """

    def __init__(
        self,
        sock: socket.socket,
        executor: Executor | None = None,
        thread_bytes: int = 0,
        stall_s: float = 10.0,
    ) -> None:
        self._sock = sock
        self._executor = executor if thread_bytes > 0 else None
        self._thread_bytes = thread_bytes
        self._stall_s = stall_s
        # The worker thread writes through a dup of the socket, so closing the loop's
        # socket object can never leave it holding a reused descriptor number.
        self._tx: socket.socket | None = None
        self._tx_active = False
        self._tx_lock = threading.Lock()
        self._loop = asyncio.get_running_loop()
        self._lock = asyncio.Lock()
        self._senders = 0  # parts being sent or queued for the lock
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False

    def try_send(self, buffers: list[Any], nbytes: int) -> list[memoryview] | None:
        """Send a part of `nbytes` inline, without a coroutine, when nobody else is
        sending and it is not one for a worker thread. None: it all went out; else the
        views still to go, which the caller passes to `send` before anything else runs."""
        if self._senders or (self._executor is not None and nbytes >= self._thread_bytes):
            return [memoryview(b) for b in buffers]
        try:
            sent = self._sock.sendmsg(buffers[:IOV_MAX])
        except (BlockingIOError, InterruptedError):
            sent = 0
        if sent == nbytes:
            return None
        views = [memoryview(b) for b in buffers]
        return self._send_some(views[advance(views, 0, sent) :]) or None

    async def send(self, buffers: list[Any], deadline: float) -> None:
        views = [memoryview(b) for b in buffers]
        self._senders += 1
        try:
            if self._executor is not None and sum(v.nbytes for v in views) >= self._thread_bytes:
                async with asyncio.timeout_at(deadline), self._lock:
                    tx = self._worker_socket()
                    await self._loop.run_in_executor(self._executor, self._send_blocking, tx, views)
                return
            rest = self._send_some(views) if self._senders == 1 else views
            if rest:
                async with asyncio.timeout_at(deadline), self._lock:
                    while rest:
                        rest = self._send_some(rest)
                        if rest:
                            await self._writable()
        finally:
            self._senders -= 1

    def _send_some(self, views: list[memoryview]) -> list[memoryview]:
        """sendmsg without waiting; return what the socket did not take yet."""
        start = 0
        while start < len(views):
            try:
                sent = self._sock.sendmsg(views[start : start + IOV_MAX])
            except (BlockingIOError, InterruptedError):
                break
            start = advance(views, start, sent)
        return views[start:]

    def _worker_socket(self) -> socket.socket:
        if self._closed:
            raise ConnectionError("connection closed")
        with self._tx_lock:
            if self._tx is None:
                self._tx = self._sock.dup()
                # A timeout keeps the shared file non-blocking (the loop needs that) and
                # makes each sendmsg wait for room in poll(), without the GIL.
                self._tx.settimeout(self._stall_s)
            self._tx_active = True
            return self._tx

    def _send_blocking(self, tx: socket.socket, views: list[memoryview]) -> None:
        """In a worker thread: send every view; `close()` wakes it with an error."""
        try:
            start = 0
            while start < len(views):
                start = advance(views, start, tx.sendmsg(views[start : start + IOV_MAX]))
        finally:
            with self._tx_lock:
                self._tx_active = False
                if self._closed and self._tx is not None:
                    self._tx.close()
                    self._tx = None

    async def _writable(self) -> None:
        if self._closed:
            raise ConnectionError("connection closed")
        waiter = self._waiter = self._loop.create_future()
        fd = self._sock.fileno()

        def wake() -> None:
            if not waiter.done():
                waiter.set_result(None)

        self._loop.add_writer(fd, wake)
        try:
            await waiter
        finally:
            self._waiter = None
            if not self._closed:
                self._loop.remove_writer(fd)

    def close(self, exc: BaseException) -> None:
        """Fail a send waiting for room; the caller closes the socket."""
        self._closed = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(ConnectionError(str(exc)))
        with self._tx_lock:
            if self._tx_active:
                # shutdown() of the shared socket makes the worker's poll/sendmsg fail.
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
            elif self._tx is not None:
                self._tx.close()
                self._tx = None
