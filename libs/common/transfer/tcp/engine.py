"""The TCP transport: a transfer server in this process, pooled connections to peers.

A batch of at most `busy_poll_bytes` goes whole to one connection and its ACK is
busy-polled (one round trip, no scheduler wake-up on a quiet peer); a larger batch
is cut into slices of at most `slice_bytes` and spread over the peer's
`connections_per_peer` connections, each part pipelined on its connection (no
per-op round trip) and acknowledged once; the batch completes when every part is
acknowledged. See tcp_frame for the wire format and tcp_server for the checks.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from typing import NoReturn

from libs.common.transfer.descriptor import U32_MAX, RegionDescriptor
from libs.common.transfer.engine import EngineState, TransferEngine
from libs.common.transfer.errors import AccessRefused, TransferError
from libs.common.transfer.ops import Op, batch_bytes, plain, slice_ops, slice_size, spread
from libs.common.transfer.region import Region
from libs.common.transfer.tcp.admission import ServerLimits
from libs.common.transfer.tcp.client import Connection
from libs.common.transfer.tcp.frame import KIND_READ, KIND_WRITE, MAX_FRAME_BYTES
from libs.common.transfer.tcp.server import TcpTransferServer

# A spread batch gives each connection at least this much: 1 MiB moves as two halves
# (thirds over three connections measured slower: docs/transfer.md).
_MIN_SHARE_BYTES = 512 << 10


class _ConnectionLost(TransferError):
    """A batch failed only because its connection went away (reset, closed, cut by the
    peer's unregister fence): `_begin` tries it once more on fresh connections."""


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint: {endpoint!r} is not host:port")
    return host.strip("[]"), int(port)


class TcpTransferEngine(TransferEngine):
    """Transfer engine over TCP; see the module docstring and engine.TransferEngine.

    host/port: where the transfer server listens (port 0: any free port).
    advertise_host: the host peers should dial (default: host, or the machine's
    name when host is a wildcard).
    stall_timeout_s: a connection whose peer stops acknowledging (a cut link, a dead
    host) fails after about this long, on both ends (see tcp_frame.set_liveness).
    busy_poll_bytes: a batch of at most this many bytes goes whole to one connection
    (the least busy) and its caller busy-polls for the ACK; a larger one is spread
    over every connection, even a single op (see ops.slice_size).
    busy_poll_us: how long that caller, and a server thread waiting for the next
    request, spin on non-blocking recvs before sleeping (0: never spin); see
    Connection.poll and tcp_server.recv_polled.
    thread_send_bytes: a batch part at least this long is sent from a worker thread
    (blocking sendmsg, no GIL held during the copy), so two connections' sends use
    two cores; 0: every part is sent from the event loop. See tcp_send.
    first_frame_timeout_s, frame_timeout_s, max_server_connections,
    max_connections_per_ip: the server's deadlines and caps against silent, slow and
    hostile peers (admission.ServerLimits, docs/security.md).
    """

    transport = "tcp"

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        connections_per_peer: int = 3,
        slice_bytes: int = 1 << 20,
        connect_timeout_s: float = 5.0,
        batch_timeout_s: float = 60.0,
        max_server_connections: int = 256,
        max_connections_per_ip: int = 64,
        first_frame_timeout_s: float = 10.0,
        frame_timeout_s: float = 10.0,
        stall_timeout_s: float = 10.0,
        busy_poll_us: float = 50.0,
        busy_poll_bytes: int = 256 << 10,
        thread_send_bytes: int = 1 << 20,
    ) -> None:
        super().__init__()
        if not 0 <= port < 65536:
            raise ValueError(f"port: {port} is not a TCP port")
        if connections_per_peer < 1:
            raise ValueError(f"connections_per_peer: must be >= 1, got {connections_per_peer}")
        if not 0 < slice_bytes <= MAX_FRAME_BYTES:
            raise ValueError(f"slice_bytes: must be in (0, {MAX_FRAME_BYTES}], got {slice_bytes}")
        if connect_timeout_s <= 0 or batch_timeout_s <= 0 or stall_timeout_s <= 0:
            raise ValueError("connect_timeout_s/batch_timeout_s/stall_timeout_s: must be positive")
        limits = ServerLimits(
            first_frame_timeout_s, frame_timeout_s, max_server_connections, max_connections_per_ip
        )
        if not 0 <= busy_poll_us <= 10_000:
            raise ValueError(f"busy_poll_us: must be in [0, 10000], got {busy_poll_us}")
        if thread_send_bytes < 0:
            raise ValueError(f"thread_send_bytes: must be >= 0, got {thread_send_bytes}")
        if busy_poll_bytes < 0:
            raise ValueError(f"busy_poll_bytes: must be >= 0, got {busy_poll_bytes}")
        self._host = host
        self._advertise = advertise_host
        self._lanes = connections_per_peer
        self._slice_bytes = slice_bytes
        self._connect_timeout_s = connect_timeout_s
        self._batch_timeout_s = batch_timeout_s
        self._stall_s = stall_timeout_s
        self._poll_us = busy_poll_us
        self._poll_s = busy_poll_us / 1e6
        self._poll_bytes = busy_poll_bytes
        self._thread_bytes = thread_send_bytes
        self._executor: ThreadPoolExecutor | None = None
        self._server = TcpTransferServer(
            self._regions, host, port, limits, self._log, stall_s=stall_timeout_s,
            poll_s=self._poll_s,
        )  # fmt: skip
        self._peers: dict[str, list[Connection]] = {}
        self._peer_locks: dict[str, asyncio.Lock] = {}
        self._batch_ids = itertools.count(1)

    @property
    def endpoint(self) -> str:
        host = self._advertise or self._host
        if host in ("", "0.0.0.0", "::"):
            host = socket.gethostname()
        if ":" in host:
            host = f"[{host}]"
        return f"{host}:{self._server.port}"

    def info(self) -> dict[str, object]:
        out = super().info()
        limits = self._server.limits
        out.update(
            connections_per_peer=self._lanes,
            slice_bytes=self._slice_bytes,
            stall_timeout_s=self._stall_s,
            busy_poll_us=self._poll_us,
            thread_send_bytes=self._thread_bytes,
            first_frame_timeout_s=limits.first_frame_s,
            frame_timeout_s=limits.frame_s,
            max_server_connections=limits.max_connections,
            max_connections_per_ip=limits.max_per_ip,
            server_connections=self._server.num_connections,
            peer_connections=sum(c.alive for conns in self._peers.values() for c in conns),
        )
        return out

    async def _start(self) -> None:
        self._server.start()
        if self._thread_bytes:
            self._executor = ThreadPoolExecutor(
                max_workers=4 * self._lanes, thread_name_prefix="tandem-transfer-send"
            )

    async def _stop(self) -> None:
        peers, self._peers = self._peers, {}
        for conns in peers.values():
            for conn in conns:
                conn.close()
        executor, self._executor = self._executor, None
        # Joining threads blocks; keep the event loop free while they exit (closing
        # the connections woke every sending thread).
        if executor is not None:
            await asyncio.to_thread(executor.shutdown, wait=True)
        await asyncio.to_thread(self._server.stop)

    def _descriptor(self, region: Region) -> RegionDescriptor:
        return RegionDescriptor(
            "tcp", self.endpoint, region.region_id, region.length, region.token.hex()
        )

    async def _connections(self, endpoint: str) -> list[Connection]:
        """Open the missing connections to `endpoint` (the slow path: `_transfer` takes
        a peer whose connections are all alive straight from `_peers`)."""
        lock = self._peer_locks.setdefault(endpoint, asyncio.Lock())
        async with lock:
            if self._state is not EngineState.RUNNING:  # stop() has closed every peer's
                raise ConnectionError(f"engine is {self._state.value}")
            conns = [c for c in self._peers.get(endpoint, []) if c.alive]
            host, port = split_endpoint(endpoint)
            missing = self._lanes - len(conns)
            if missing > 0:
                opened = await asyncio.gather(
                    *(
                        Connection.open(
                            host,
                            port,
                            self._connect_timeout_s,
                            self._stall_s,
                            self._executor,
                            self._thread_bytes,
                        )
                        for _ in range(missing)
                    ),
                    return_exceptions=True,
                )
                errors = [c for c in opened if isinstance(c, BaseException)]
                conns += [c for c in opened if isinstance(c, Connection)]
                if not conns:
                    raise errors[0]
            self._peers[endpoint] = conns
            return conns

    async def _transfer(
        self, kind: str, region: Region, remote: RegionDescriptor, ops: list[Op]
    ) -> None:
        if len(ops) > U32_MAX:
            raise ValueError(f"ops: at most {U32_MAX} ops per batch")
        total = batch_bytes(ops)
        if not total:
            return
        peer = remote.endpoint
        conns = self._peers.get(peer)
        if not conns or not all([c.alive for c in conns]):
            try:
                conns = await self._connections(peer)
            except (OSError, TimeoutError) as exc:
                raise TransferError(peer, f"cannot connect: {exc}") from exc
        if total <= self._poll_bytes or len(conns) == 1:
            # One part on the least busy connection (a small batch, or a single lane).
            conn = conns[0]
            if conn.backlog() and len(conns) > 1:
                conn = min(conns, key=Connection.backlog)
            pending = self._one_part(kind, conn, region, remote, ops, total <= self._poll_bytes)
            if pending is not None:
                await pending
            return
        # Every connection gets a share, even of a single op (1 MiB: two halves).
        code = KIND_WRITE if kind == "write" else KIND_READ
        batch_id = next(self._batch_ids)
        deadline = asyncio.get_running_loop().time() + self._batch_timeout_s
        share = min(len(conns), -(-total // _MIN_SHARE_BYTES))
        lanes = spread(slice_ops(ops, slice_size(total, share, self._slice_bytes)), share)
        used = [(c, lane) for c, lane in zip(conns, lanes, strict=False) if lane]
        tasks = [c.run(code, batch_id, lane, region.view, remote, deadline) for c, lane in used]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        if any(isinstance(r, BaseException) for r in results):
            self._raise_failure(kind, peer, ops, results, used)

    def _begin(
        self, kind: str, region: Region, remote: RegionDescriptor, ops: list[Op]
    ) -> Awaitable[None] | None:
        """A small batch to a peer whose first connection is up and idle goes out and is
        busy-polled right here, with no coroutine at all (`_one_part`): on a slow core
        each coroutine layer is a measurable part of a 4 KiB write (docs/transfer.md).
        Anything else (a large batch, a busy or missing connection) goes through
        `_transfer`.

        A batch that fails only because its connection was lost is sent once more on
        fresh connections (`_ConnectionLost`): ops are idempotent (the same bytes to
        the same places), and the server checks each again, so a batch for a region
        that is gone meanwhile is refused. This keeps one peer's cut connection (its
        unregister fence stopping another batch) from failing every batch that was
        queued behind on it."""
        try:
            pending = self._begin_once(kind, region, remote, ops)
        except _ConnectionLost as lost:
            return self._retry(lost, kind, region, remote, ops)
        return None if pending is None else self._settle(pending, kind, region, remote, ops)

    def _begin_once(
        self, kind: str, region: Region, remote: RegionDescriptor, ops: list[Op]
    ) -> Awaitable[None] | None:
        conns = self._peers.get(remote.endpoint)
        if conns and len(ops) <= U32_MAX:
            total = batch_bytes(ops)
            conn = conns[0]
            if 0 < total <= self._poll_bytes and conn.alive and not conn.backlog():
                return self._one_part(kind, conn, region, remote, ops, True)
        return self._transfer(kind, region, remote, ops)

    async def _settle(
        self,
        pending: Awaitable[None],
        kind: str,
        region: Region,
        remote: RegionDescriptor,
        ops: list[Op],
    ) -> None:
        try:
            await pending
        except _ConnectionLost as lost:
            await self._retry(lost, kind, region, remote, ops)

    async def _retry(
        self,
        lost: _ConnectionLost,
        kind: str,
        region: Region,
        remote: RegionDescriptor,
        ops: list[Op],
    ) -> None:
        if self._state is not EngineState.RUNNING:  # stopping: no new connections
            raise TransferError(lost.peer, lost.reason, lost.op_index, lost.op) from lost
        self._log.info("transfer batch sent again on a fresh connection", peer=lost.peer,
                       kind=kind, reason=lost.reason)  # fmt: skip
        try:
            await self._transfer(kind, region, remote, ops)
        except _ConnectionLost as again:  # once only: a plain TransferError now
            raise TransferError(again.peer, again.reason, again.op_index, again.op) from again

    def _one_part(
        self,
        kind: str,
        conn: Connection,
        region: Region,
        remote: RegionDescriptor,
        ops: list[Op],
        poll: bool,
    ) -> Awaitable[None] | None:
        """The whole batch as one part on `conn`, sent inline (Connection.submit); with
        `poll`, its ACK busy-polled. None when it has landed, else the coroutine that
        waits for it. Failures raise TransferError, as for a spread batch."""
        lane = slice_ops(ops, self._slice_bytes)
        code = KIND_WRITE if kind == "write" else KIND_READ
        try:
            future, rest = conn.submit(code, next(self._batch_ids), lane, region.view, remote)
        except Exception as exc:
            self._raise_failure(kind, remote.endpoint, ops, [exc], [(conn, lane)])
        if rest is None and poll and self._poll_s:
            conn.poll(future, self._poll_s)
        if rest is not None or not future.done():
            return self._finish_part(
                kind, conn, future, rest, peer=remote.endpoint, ops=ops, lane=lane
            )
        failure = future.exception()
        if failure is not None:
            self._raise_failure(kind, remote.endpoint, ops, [failure], [(conn, lane)])
        return None

    async def _finish_part(
        self,
        kind: str,
        conn: Connection,
        future: asyncio.Future[None],
        rest: list[memoryview] | None,
        *,
        peer: str,
        ops: list[Op],
        lane: list,
    ) -> None:
        deadline = asyncio.get_running_loop().time() + self._batch_timeout_s
        try:
            await conn.finish(future, rest, deadline)
        except Exception as exc:
            self._raise_failure(kind, peer, ops, [exc], [(conn, lane)])

    def _raise_failure(
        self, kind: str, peer: str, ops: list[Op], results: list, used: list
    ) -> NoReturn:
        """Turn a batch's failed parts into one TransferError (timeouts first)."""
        if any(isinstance(r, TimeoutError) for r in results):
            # The parts may still be queued on these connections: drop them, so a
            # late ACK can never be taken for a later batch's.
            for c, _ in used:
                c.close(TimeoutError("batch timed out"))
            raise TransferError(peer, f"{kind} timed out after {self._batch_timeout_s}s")
        for result in results:
            if isinstance(result, AccessRefused):
                index = getattr(result, "op_index", -1)
                op = plain(ops[index]) if 0 <= index < len(ops) else None
                self._log.warning("transfer refused by peer", peer=peer, op_index=index,
                                  reason=result.reason)  # fmt: skip
                raise TransferError(peer, f"refused: {result.reason}", index, op) from result
        # Callers pass results holding at least one exception.
        failure = next(r for r in results if isinstance(r, BaseException))
        # A socket error (reset, closed under a queued part: EBADF, EPIPE) is the
        # connection's, not the batch's (timeouts were handled above).
        error = _ConnectionLost if isinstance(failure, OSError) else TransferError
        raise error(peer, f"{kind} failed: {failure}") from failure
