"""The TCP transfer server: applies peers' WRITE and READ ops to registered regions.

One thread per connection with blocking sockets. Measured against asyncio
(docs/transfer.md, "Choices, measured"): the kernel copies of `recv_into`/`sendmsg`
release the GIL, so the threads move bytes while the service's event loop keeps
running, and there is no per-op event-loop round trip. Payloads go straight from the
socket into the region (`recv_into` on a memoryview slice) and from the region into the
socket (`sendmsg` of a memoryview slice): no intermediate copies. A thread waiting for
the next request spins on poll(0) for `poll_s` before it sleeps in the kernel
(`sockio.wait_readable`): a peer's next small batch is then served without a wake-up.

Every op is checked (region id, constant-time token compare, bounds) before any
byte of its payload is read into the region; see tcp_frame for the protocol. Which
connections are kept, and how long a frame may take, is admission.py's.
"""

from __future__ import annotations

import contextlib
import math
import select
import socket
import threading
import time
from typing import Any

from libs.common.transfer.errors import AccessRefused
from libs.common.transfer.region import Region, RegionTable
from libs.common.transfer.tcp.admission import Admission, PeerConnection, ServerLimits
from libs.common.transfer.tcp.fence import OpFence
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
from libs.common.transfer.tcp.sockio import (
    FrameTimeout,
    recv_exact,
    send_all,
    send_small,
    set_tick,
    wait_readable,
)

_DRAIN_CHUNK = 1 << 16


class TcpTransferServer:
    """Listens on (host, port); serves ops against `regions` until `stop()`.

    Peers that are silent, slow or without a token cannot hold the port (docs/security.md,
    "Transfer ports"): a new connection must send a request that passes the access check
    within `first_frame_s`; once a frame has begun, its header must be in within
    `frame_s` and its payload within `frame_s` plus one second per MIN_RATE bytes; the
    caps and who gives way are admission.Admission's. A proven connection may idle
    between frames for as long as its peer is alive (keepalive, `stall_s`): peers pool
    their connections.
    """

    def __init__(
        self,
        regions: RegionTable,
        host: str,
        port: int,
        limits: ServerLimits,
        log: Any,
        *,
        stall_s: float = 10.0,
        poll_s: float = 0.0,
    ) -> None:
        self._regions = regions
        self._host = host
        self._port = port
        self._limits = limits
        self._admission = Admission(limits.max_connections, limits.max_per_ip)
        self._log = log
        self._stall_s = stall_s
        self._poll_s = poll_s
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._lock = threading.Lock()  # admission and thread start, against stop()
        self._stopping = threading.Event()

    @property
    def num_connections(self) -> int:
        return len(self._admission)

    @property
    def limits(self) -> ServerLimits:
        return self._limits

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
            conns = self._admission.all()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        threads = [c.thread for c in conns if c.thread is not None]
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
            conn = PeerConnection(sock, peer[0], f"{peer[0]}:{peer[1]}")
            with self._lock:
                kept, evicted = self._admission.admit(conn)
                if kept:
                    conn.thread = threading.Thread(
                        target=self._serve, args=(conn,), daemon=True,
                        name=f"tandem-transfer-{conn.name}",
                    )  # fmt: skip
                    conn.thread.start()  # under the lock: stop() never joins an unstarted one
            if evicted is not None:
                self._log.warning("transfer connection evicted: no admitted op yet",
                                  peer=evicted.name, by=conn.name)  # fmt: skip
                with contextlib.suppress(OSError):  # its thread wakes and closes it
                    evicted.sock.shutdown(socket.SHUT_RDWR)
            if not kept:
                self._log.warning(
                    "transfer connection refused: too many", peer=conn.name,
                    from_ip=self._admission.count(conn.ip), total=len(self._admission),
                )  # fmt: skip
                sock.close()

    def _serve(self, conn: PeerConnection) -> None:
        sock, peer = conn.sock, conn.name
        fence = OpFence(sock)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_liveness(sock, self._stall_s)  # a cut link must not hold this thread
            set_tick(sock, self._limits.tick_s)
            self._serve_frames(conn, fence)
        except FrameTimeout as exc:
            self._log.warning("transfer peer too slow: connection closed", peer=peer,
                              error=str(exc), proven=conn.proven)  # fmt: skip
        except OSError as exc:
            if not self._stopping.is_set():
                self._log.warning("transfer connection error", peer=peer, error=str(exc))
        finally:
            with self._lock:
                self._admission.release(conn)
            fence.close()

    def _serve_frames(self, conn: PeerConnection, cut: OpFence) -> None:
        sock, peer, limits = conn.sock, conn.name, self._limits
        header = memoryview(bytearray(REQUEST.size))
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        # Until an op is admitted, everything must happen before this.
        first_deadline = time.monotonic() + limits.first_frame_s
        failed_batch: int | None = None  # batch refused on this connection, until LAST
        while True:
            deadline = math.inf if conn.proven else first_deadline
            # a peer that keeps refused ops coming never waits: look at the clock too
            late = not conn.proven and time.monotonic() >= deadline
            if late or not wait_readable(poller.poll, self._poll_s, deadline):
                raise FrameTimeout(f"no admitted request within {limits.first_frame_s}s")
            got = recv_exact(sock, header, limits.frame_s, deadline)
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
            budget = limits.payload_budget(length)
            if failed_batch is not None and failed_batch != batch_id:
                failed_batch = None  # a new batch starts clean
            if failed_batch is None:
                cut.start(region_id)
                try:
                    op_kind = "write" if kind == KIND_WRITE else "read"
                    region = self._regions.enter(region_id, token, offset, length, cut, op_kind)
                    conn.proven = True
                except AccessRefused as exc:
                    cut.end()
                    self._log.warning(
                        "transfer op refused", peer=peer, reason=exc.detail,
                        batch_id=batch_id, op_index=op_index,
                    )  # fmt: skip
                    reason = error_payload(exc.reason)
                    # a token-less peer that stops reading its ERRs: first_frame_s holds
                    left = limits.frame_s if conn.proven else first_deadline - time.monotonic()
                    send_all(sock, [pack_response(KIND_ERR, op_index, batch_id, len(reason)),
                                    reason], max(left, 0.0))  # fmt: skip
                    failed_batch = batch_id
            if failed_batch == batch_id:
                if kind == KIND_WRITE and not self._drain(sock, length, peer, deadline, budget):
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
                budget=budget,
            ):
                return
            if flags & FLAG_LAST:
                if failed_batch != batch_id:
                    send_small(sock, pack_response(KIND_ACK, op_index, batch_id, 0), limits.frame_s)
                failed_batch = None

    def _apply(
        self, sock: socket.socket, peer: str, region: Region, cut: OpFence, *,
        kind: int, op_index: int, batch_id: int, offset: int, length: int, budget: float,
    ) -> bool:  # fmt: skip
        """Move one admitted op's bytes (region entered by `_serve_frames`); False when
        the connection is done for (peer gone, or the region unregistered meanwhile)."""
        try:
            if kind == KIND_WRITE:
                got = recv_exact(sock, region.view[offset : offset + length], budget)
                if got != length:
                    self._log.warning(
                        "transfer peer disconnected mid-payload", peer=peer,
                        region_id=region.region_id, expected=length, received=got,
                        unregistered=not region.live,
                    )  # fmt: skip
                    return False
            else:
                source = region.view[offset : offset + length]
                send_all(sock, [pack_response(KIND_DATA, op_index, batch_id, length), source],
                         budget)  # fmt: skip
        finally:
            self._regions.leave(region, cut)
            cut.end()
        return True

    def _drain(
        self, sock: socket.socket, length: int, peer: str, deadline: float, budget: float
    ) -> bool:
        """Discard a refused WRITE's payload so the stream stays in sync (within the
        frame's budget, and for an unproven connection its first-frame deadline)."""
        deadline = min(deadline, time.monotonic() + budget)
        scratch = memoryview(bytearray(min(length, _DRAIN_CHUNK) or 1))
        left = length
        while left:
            got = recv_exact(sock, scratch[: min(left, scratch.nbytes)], math.inf, deadline)
            if got == 0:
                self._log.warning("transfer peer disconnected mid-payload", peer=peer)
                return False
            left -= got
        return True
