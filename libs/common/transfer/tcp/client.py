"""Client side of the TCP transport: pipelined connections to one peer, on asyncio.

A `Connection` sends each batch part through tcp_send.PartSender (one gathered
`sendmsg` of headers and payload memoryviews, no copies) and keeps a FIFO of parts
awaiting their ACK/ERR; a reader callback matches responses to parts in order (the
server answers strictly in order) and receives READ data straight into the local
region with `recv_into`. A small part's caller busy-polls that same callback for a
bounded time instead of sleeping until the loop wakes it (`poll`).

    caller tasks --part--> PartSender --sendmsg--> socket --> server
                  <--future--- pending FIFO <--reader callback / poll--- ACK / DATA / ERR
"""

from __future__ import annotations

import asyncio
import collections
import select
import socket
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from libs.common.transfer.errors import AccessRefused
from libs.common.transfer.ops import Slice
from libs.common.transfer.tcp.frame import (
    FLAG_LAST,
    KIND_ACK,
    KIND_DATA,
    KIND_ERR,
    KIND_WRITE,
    MAGIC,
    MAX_ERROR_BYTES,
    REQUEST,
    RESPONSE,
    VERSION,
    set_liveness,
)
from libs.common.transfer.tcp.send import PartSender


class ProtocolError(ConnectionError):
    """The peer sent something that does not follow tcp_frame; the connection is dropped."""


@dataclass(eq=False, slots=True)
class _Part:
    batch_id: int
    future: asyncio.Future[None]
    view: memoryview  # the local region
    reads: collections.deque[Slice] | None = None  # READ slices awaiting their DATA


class Connection:
    """One TCP connection to a peer's transfer server."""

    def __init__(
        self,
        sock: socket.socket,
        peer: str,
        executor: Executor | None = None,
        thread_bytes: int = 0,
        stall_s: float = 10.0,
    ) -> None:
        self._sock = sock
        self.peer = peer
        self._loop = asyncio.get_running_loop()
        self._sender = PartSender(sock, executor, thread_bytes, stall_s)
        self._pending: collections.deque[_Part] = collections.deque()
        self._closed: BaseException | None = None
        self._fd = sock.fileno()
        self._rx_header = bytearray(RESPONSE.size)
        self._rx_header_view = memoryview(self._rx_header)
        self._rx_target = self._rx_header_view
        self._rx_got = 0
        self._rx_kind = 0
        self._rx_op_index = 0
        self._ready = select.poll()
        self._ready.register(self._fd, select.POLLIN)
        self._loop.add_reader(self._fd, self._on_readable)

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        timeout_s: float,
        stall_s: float = 10.0,
        executor: Executor | None = None,
        thread_bytes: int = 0,
    ) -> Connection:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        set_liveness(sock, stall_s)
        try:
            async with asyncio.timeout(timeout_s):
                await loop.sock_connect(sock, (host, port))
        except BaseException:
            sock.close()
            raise
        return cls(sock, f"{host}:{port}", executor, thread_bytes, stall_s)

    @property
    def alive(self) -> bool:
        return self._closed is None

    def backlog(self) -> int:
        """Parts sent or being sent on this connection and not yet answered."""
        return len(self._pending)

    def submit(
        self, kind: int, batch_id: int, slices: list[Slice], view: memoryview, remote: Any
    ) -> tuple[asyncio.Future[None], list[memoryview] | None]:
        """Queue one batch part and send what the socket takes now, without a coroutine.

        Returns the part's future (done on its ACK, AccessRefused on ERR) and the
        views still to send, which must go to `finish` before anything else runs;
        None when all of it went out (an idle connection, a small part).
        """
        if self._closed is not None:
            raise ConnectionError(f"connection closed: {self._closed}")
        future = self._loop.create_future()
        part = _Part(batch_id, future, view)
        token = remote.token_bytes
        region_id = remote.region_id
        buffers: list[Any] = []
        nbytes = REQUEST.size * len(slices)
        last = len(slices) - 1
        write = kind == KIND_WRITE
        if not write:
            part.reads = collections.deque(slices)
        pack = REQUEST.pack
        for i, s in enumerate(slices):
            buffers.append(
                pack(MAGIC, VERSION, kind, FLAG_LAST if i == last else 0, s.op_index, 0,
                     batch_id, region_id, s.remote_off, s.length, token)
            )  # fmt: skip
            if write:
                buffers.append(view[s.local_off : s.local_off + s.length])
                nbytes += s.length
        self._pending.append(part)
        try:
            return future, self._sender.try_send(buffers, nbytes)
        except BaseException as exc:
            self._drop(exc)
            raise

    async def finish(
        self, future: asyncio.Future[None], rest: list[memoryview] | None, deadline: float
    ) -> None:
        """Send a submitted part's `rest`, then wait for its ACK until `deadline` (loop
        time; TimeoutError after it)."""
        if rest is not None:
            try:
                await self._sender.send(rest, deadline)
            except BaseException as exc:
                self._drop(exc)
                raise
        if not future.done():
            async with asyncio.timeout_at(deadline):
                await future
        future.result()

    async def run(
        self,
        kind: int,
        batch_id: int,
        slices: list[Slice],
        view: memoryview,
        remote: Any,
        deadline: float,
    ) -> None:
        """Send one batch part and wait for its ACK (`submit`, then `finish`)."""
        future, rest = self.submit(kind, batch_id, slices, view, remote)
        await self.finish(future, rest, deadline)

    def _drop(self, exc: BaseException) -> None:
        # A half-sent part leaves the stream out of sync: drop the connection.
        self.close(exc if isinstance(exc, Exception) else ConnectionError("cancelled"))

    def poll(self, future: asyncio.Future[None], budget_s: float) -> None:
        """Busy-poll the socket until `future` is done or `budget_s` has passed.

        A sleeping thread costs a scheduler wake-up, twice per round trip, more than a
        small batch itself (docs/transfer.md, "Busy-polling"); like RDMA
        completion polling, spinning a bounded time on non-blocking recvs takes the
        answer as soon as it lands. Blocks the event loop for at most `budget_s`.
        """
        end = time.perf_counter() + budget_s
        ready = self._ready.poll  # poll(0) answers "nothing yet" cheaper than a recv
        while self._closed is None:
            if ready(0):
                self._on_readable()
                if future.done():
                    return
            if time.perf_counter() >= end:
                return

    def _on_readable(self) -> None:
        """Event-loop reader callback: receive as much as is there, dispatch frames.

        A callback, not a task, so an ACK resolves its batch in the same loop
        iteration it arrives in (this is most of a small write's latency).
        """
        try:
            while self._closed is None:
                target = self._rx_target
                n = self._sock.recv_into(target[self._rx_got :])
                if n == 0:
                    raise ConnectionError(f"peer {self.peer} closed the connection")
                self._rx_got += n
                if self._rx_got == target.nbytes:
                    self._rx_got = 0
                    self._frame_done()
                    if not self._pending:
                        return  # nothing more is due: skip the recv that would EAGAIN
        except (BlockingIOError, InterruptedError):
            return
        except Exception as exc:
            self.close(exc)

    def _frame_done(self) -> None:
        """A header, a DATA payload or an ERR reason is complete; pick the next target."""
        if self._rx_kind == KIND_DATA:
            self._expect_header()
            return
        if self._rx_kind == KIND_ERR:
            part = self._pending.popleft()
            exc = AccessRefused(bytes(self._rx_target).decode("utf-8", "replace"))
            exc.op_index = self._rx_op_index
            if not part.future.done():
                part.future.set_exception(exc)
            self._expect_header()
            return
        magic, version, kind, _, op_index, _, batch_id, length = RESPONSE.unpack(self._rx_header)
        if magic != MAGIC or version != VERSION or not self._pending:
            raise ProtocolError(f"unexpected response from {self.peer}")
        part = self._pending[0]
        if batch_id != part.batch_id:
            raise ProtocolError(f"response for batch {batch_id}, expected {part.batch_id}")
        if kind == KIND_ACK and not part.reads:
            self._pending.popleft()
            if not part.future.done():
                part.future.set_result(None)
        elif kind == KIND_DATA and part.reads:
            s = part.reads.popleft()
            if s.length != length or s.op_index != op_index:
                raise ProtocolError(f"unexpected DATA from {self.peer}")
            # Received straight into the local region, no bounce buffer.
            self._rx_kind = KIND_DATA
            self._rx_target = part.view[s.local_off : s.local_off + length]
        elif kind == KIND_ERR and 0 < length <= MAX_ERROR_BYTES:
            self._rx_kind, self._rx_op_index = KIND_ERR, op_index
            self._rx_target = memoryview(bytearray(length))
        else:
            raise ProtocolError(f"unexpected response kind {kind} from {self.peer}")

    def _expect_header(self) -> None:
        self._rx_kind, self._rx_target = 0, self._rx_header_view

    def _fail(self, exc: BaseException) -> None:
        """Mark the connection dead and fail every part still waiting on it."""
        if self._closed is None:
            self._closed = exc
        self._sender.close(exc)
        while self._pending:
            part = self._pending.popleft()
            if not part.future.done():
                part.future.set_exception(ConnectionError(str(exc) or type(exc).__name__))
                # Its sender may have been cancelled: never warn "exception not retrieved".
                part.future.exception()

    def close(self, exc: BaseException | None = None) -> None:
        """Drop the connection; parts in flight fail with ConnectionError. Idempotent."""
        first = self._closed is None
        self._fail(exc or ConnectionError("connection closed"))
        if first:
            self._loop.remove_reader(self._fd)
            self._loop.remove_writer(self._fd)
            self._sock.close()
