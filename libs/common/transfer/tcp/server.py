"""The TCP transfer server: applies peers' WRITE and READ ops to registered regions.

One thread per connection with blocking sockets. Measured against asyncio
(docs/transfer.md, "Choices, measured"): the kernel copies of `recv_into`/`sendmsg`
release the GIL, so the threads move bytes while the service's event loop keeps
running, and there is no per-op event-loop round trip. Payloads go straight from the
socket into the region (`recv_into` on a memoryview slice) and from the region into the
socket (`sendmsg` of a memoryview slice): no intermediate copies. A thread waiting for
the next request spins on poll(0) for `poll_s` before it sleeps in the
kernel (`recv_polled`): a peer's next small batch is then served without a wake-up.

Every op is checked (region id, constant-time token compare, bounds) before any
byte of its payload is read into the region; see tcp_frame for the protocol.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from typing import Any

from libs.common.transfer.errors import AccessRefused
from libs.common.transfer.region import Region, RegionTable
from libs.common.transfer.tcp.frame import (
    FLAG_LAST,
    KIND_ACK,
    KIND_DATA,
    KIND_ERR,
    KIND_READ,
    KIND_WRITE,
    MAGIC,
    MAX_FRAME_BYTES,
    REQUEST,
    VERSION,
    error_payload,
    pack_response,
    set_liveness,
)

_DRAIN_CHUNK = 1 << 16


def recv_exact(sock: socket.socket, view: memoryview) -> int:
    """Fill `view` from a blocking socket; return the bytes received (< len on EOF)."""
    got, total = 0, view.nbytes
    while got < total:
        n = sock.recv_into(view[got:], total - got, socket.MSG_WAITALL)
        if n == 0:
            break
        got += n
    return got


def recv_polled(sock: socket.socket, view: memoryview, poll_s: float, ready: Any) -> int:
    """recv_exact, but first spin for up to `poll_s` on `ready` (a select.poll of the
    socket) until something arrives.

    A thread asleep in recv pays a scheduler wake-up when the next request lands; a
    peer that sends its next batch right after an ACK is served without it. poll(0)
    answers "nothing yet" cheaper than a non-blocking recv that
    raises, and releases the GIL each time, so the spin does not hold the service's
    event loop for more than one syscall at a time.
    """
    if poll_s > 0:
        end = time.perf_counter() + poll_s
        while not ready(0) and time.perf_counter() < end:
            pass
    return recv_exact(sock, view)


def send_all(sock: socket.socket, buffers: list[Any]) -> None:
    """sendmsg every buffer (blocking socket), resuming after partial sends."""
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        sent = sock.sendmsg(views[:1024])
        while sent and views:
            if sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


class _OpFence:
    """Unregister's hold on one server connection: the region its op is moving bytes for
    right now, and the cut (`RegionTable.remove` calls it with the region going away).

    The cut shuts the connection down only while that same region's op is running (a
    cut from a stale list of users must not kill the connection's next op, on another
    region), and never races the socket's close (a reused descriptor number)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self._region_id = 0  # region ids are never 0

    def start(self, region_id: int) -> None:
        with self._lock:
            self._region_id = region_id

    def end(self) -> None:
        with self._lock:
            self._region_id = 0

    def __call__(self, region: Region) -> None:
        with self._lock:
            if self._region_id == region.region_id:
                with contextlib.suppress(OSError):  # recv/send in the thread return at once
                    self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            self._sock.close()


class TcpTransferServer:
    """Listens on (host, port); serves ops against `regions` until `stop()`."""

    def __init__(
        self,
        regions: RegionTable,
        host: str,
        port: int,
        max_connections: int,
        log: Any,
        *,
        stall_s: float = 10.0,
        poll_s: float = 0.0,
    ) -> None:
        self._regions = regions
        self._host = host
        self._port = port
        self._max_connections = max_connections
        self._log = log
        self._stall_s = stall_s
        self._poll_s = poll_s
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    @property
    def num_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1] if self._listener is not None else self._port

    def start(self) -> None:
        listener = socket.create_server((self._host, self._port), backlog=128)
        self._listener = listener
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name="tandem-transfer-accept", daemon=True
        )
        self._accept_thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        if self._listener is not None:
            # shutdown() wakes a thread blocked in accept(); close() alone does not.
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        with self._lock:
            conns = list(self._conns.items())
        for sock, _ in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        threads = [t for _, t in conns]
        if self._accept_thread is not None:
            threads.append(self._accept_thread)
        for thread in threads:
            thread.join(timeout_s)

    def _accept_loop(self) -> None:
        listener = self._listener
        while listener is not None and not self._stopping.is_set():
            try:
                sock, peer = listener.accept()
            except OSError:
                return  # listener shut down
            peer_name = f"{peer[0]}:{peer[1]}"
            with self._lock:
                crowded = len(self._conns) >= self._max_connections
                if not crowded:
                    thread = threading.Thread(
                        target=self._serve, args=(sock, peer_name), daemon=True,
                        name=f"tandem-transfer-{peer_name}",
                    )  # fmt: skip
                    self._conns[sock] = thread
                    thread.start()  # under the lock: stop() never joins an unstarted thread
            if crowded:
                self._log.warning("transfer connection refused: too many", peer=peer_name)
                sock.close()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        fence = _OpFence(sock)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_liveness(sock, self._stall_s)  # a cut link must not hold this thread
            self._serve_frames(sock, peer, fence)
        except OSError as exc:
            if not self._stopping.is_set():
                self._log.warning("transfer connection error", peer=peer, error=str(exc))
        finally:
            with self._lock:
                self._conns.pop(sock, None)
            fence.close()

    def _serve_frames(self, sock: socket.socket, peer: str, cut: _OpFence) -> None:
        header = memoryview(bytearray(REQUEST.size))
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        failed_batch: int | None = None  # batch refused on this connection, until LAST
        while True:
            got = recv_polled(sock, header, self._poll_s, poller.poll)
            if got != REQUEST.size:
                if got:
                    self._log.warning("transfer peer disconnected mid-header", peer=peer)
                return
            (magic, version, kind, flags, op_index, _, batch_id, region_id, offset, length,
             token) = REQUEST.unpack(header)  # fmt: skip
            if magic != MAGIC or version != VERSION or kind not in (KIND_WRITE, KIND_READ):
                self._log.warning(
                    "transfer refused garbage header", peer=peer, magic=hex(magic),
                    version=version, kind=kind,
                )  # fmt: skip
                return
            if length > MAX_FRAME_BYTES:
                self._log.warning("transfer refused oversized frame", peer=peer, length=length)
                return
            if failed_batch is not None and failed_batch != batch_id:
                failed_batch = None  # a new batch starts clean
            if failed_batch is None:
                cut.start(region_id)
                try:
                    region = self._regions.enter(region_id, token, offset, length, cut)
                except AccessRefused as exc:
                    cut.end()
                    self._log.warning(
                        "transfer op refused", peer=peer, reason=exc.reason,
                        batch_id=batch_id, op_index=op_index,
                    )  # fmt: skip
                    reason = error_payload(exc.reason)
                    send_all(sock, [pack_response(KIND_ERR, op_index, batch_id, len(reason)),
                                    reason])  # fmt: skip
                    failed_batch = batch_id
            if failed_batch == batch_id:
                if kind == KIND_WRITE and not self._drain(sock, length, peer):
                    return
            elif not self._apply(
                sock,
                peer,
                region,
                cut,
                kind=kind,
                op_index=op_index,
                batch_id=batch_id,
                offset=offset,
                length=length,
            ):
                return
            if flags & FLAG_LAST:
                if failed_batch != batch_id:
                    sock.sendall(pack_response(KIND_ACK, op_index, batch_id, 0))
                failed_batch = None

    def _apply(
        self, sock: socket.socket, peer: str, region: Region, cut: _OpFence, *,
        kind: int, op_index: int, batch_id: int, offset: int, length: int,
    ) -> bool:  # fmt: skip
        """Move one admitted op's bytes (region entered by `_serve_frames`); False when
        the connection is done for (peer gone, or the region unregistered meanwhile)."""
        try:
            if kind == KIND_WRITE:
                got = recv_exact(sock, region.view[offset : offset + length])
                if got != length:
                    self._log.warning(
                        "transfer peer disconnected mid-payload", peer=peer,
                        region_id=region.region_id, expected=length, received=got,
                        unregistered=not region.live,
                    )  # fmt: skip
                    return False
            else:
                source = region.view[offset : offset + length]
                send_all(sock, [pack_response(KIND_DATA, op_index, batch_id, length), source])
        finally:
            self._regions.leave(region, cut)
            cut.end()
        return True

    def _drain(self, sock: socket.socket, length: int, peer: str) -> bool:
        """Discard a refused WRITE's payload so the stream stays in sync."""
        scratch = memoryview(bytearray(min(length, _DRAIN_CHUNK) or 1))
        left = length
        while left:
            got = recv_exact(sock, scratch[: min(left, scratch.nbytes)])
            if got == 0:
                self._log.warning("transfer peer disconnected mid-payload", peer=peer)
                return False
            left -= got
        return True
