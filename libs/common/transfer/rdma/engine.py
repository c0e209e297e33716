"""The rdma transport: pyverbs, RC queue pairs, one-sided RDMA WRITE and READ.

Wiring (the engine never talks to NATS itself):

    async def connect_peer(endpoint: str, request: dict) -> dict:
        # endpoint is the peer's RegionDescriptor.endpoint (its engine id)
        reply = await bus.request(f"tandem.transfer.{endpoint}.connect", request)
        return reply                                  # a QpExchange dict

    engine = RdmaTransferEngine(connect_peer=connect_peer, engine_id=worker_id)
    bus.serve(f"tandem.transfer.{worker_id}.connect", engine.accept_peer)

`accept_peer` refuses (ValueError) a request whose region id and token do not match a
region registered here: once connected, the NIC checks the rkey and the bounds of
the memory region for every op, without the owner's CPU.

Completions are polled by a task on the event loop (ibv_poll_cq never blocks): it
spins while work requests are outstanding, backs off, and sleeps on an event when
none are. Every WR is signaled so the first failure names its op.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from libs.common.transfer.descriptor import RegionDescriptor
from libs.common.transfer.engine import TransferEngine
from libs.common.transfer.errors import AccessRefused, TransferError
from libs.common.transfer.ops import Op, plain, slice_ops, spread
from libs.common.transfer.rdma.device import VerbsDevice
from libs.common.transfer.rdma.link import Link, LinkState, QpExchange, QpInfo, WorkTracker
from libs.common.transfer.rdma.shim import load as load_pyverbs
from libs.common.transfer.region import Region
from libs.common.transfer.registry import rdma_devices

ConnectPeer = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


class RdmaTransferEngine(TransferEngine):
    """Transfer engine over RDMA RC queue pairs; see the module docstring for wiring."""

    transport = "rdma"

    def __init__(
        self,
        *,
        connect_peer: ConnectPeer | None = None,
        engine_id: str | None = None,
        device: str | None = None,
        port_num: int = 1,
        gid_index: int = 0,
        qps_per_peer: int = 2,
        slice_bytes: int = 1 << 20,
        max_send_wr: int = 128,
        batch_timeout_s: float = 60.0,
    ) -> None:
        super().__init__()
        if connect_peer is None:
            raise ValueError("connect_peer: the rdma transport needs the QP exchange callable")
        if not 1 <= qps_per_peer <= 64:
            raise ValueError(f"qps_per_peer: must be in [1, 64], got {qps_per_peer}")
        if slice_bytes <= 0 or max_send_wr <= 0 or batch_timeout_s <= 0:
            raise ValueError("slice_bytes/max_send_wr/batch_timeout_s: must be positive")
        self._connect_peer = connect_peer
        self._engine_id = engine_id or f"rdma-{secrets.token_hex(8)}"
        self._device = device
        self._port_num = port_num
        self._gid_index = gid_index
        self._dev: VerbsDevice | None = None
        self._nqps = qps_per_peer
        self._slice_bytes = slice_bytes
        self._max_send_wr = max_send_wr
        self._batch_timeout_s = batch_timeout_s
        self._links: dict[str, tuple[Link, list[Any]]] = {}
        self._accepted: dict[str, list[Any]] = {}
        self._connect_locks: dict[str, asyncio.Lock] = {}
        self._tracker = WorkTracker()
        self._batches: dict[int, asyncio.Future[None]] = {}
        self._credits: dict[int, asyncio.Semaphore] = {}  # per QP number
        self._wr_qp: dict[int, int] = {}
        self._posted = asyncio.Event()
        self._poller: asyncio.Task[None] | None = None
        self._batch_ids = itertools.count(1)

    @property
    def endpoint(self) -> str:
        return self._engine_id

    def info(self) -> dict[str, Any]:
        out = super().info()
        out.update(device=self._device, qps_per_peer=self._nqps)
        return out

    async def _start(self) -> None:
        devices = rdma_devices()
        if not devices:
            raise RuntimeError("rdma: no device under /sys/class/infiniband")
        self._device = self._device or devices[0]
        self._dev = VerbsDevice(self._device, self._port_num, self._gid_index, self._max_send_wr)
        # CQ sized for every QP of 8 peers with full send queues.
        self._dev.open(4 * self._max_send_wr * self._nqps * 8, load_pyverbs())
        self._poller = asyncio.get_running_loop().create_task(self._poll(), name="rdma-poll")

    async def _stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        for future in self._batches.values():
            if not future.done():
                future.set_exception(ConnectionError("engine stopped"))
        for _, qps in self._links.values():
            for qp in qps:
                qp.close()
        for qps in self._accepted.values():
            for qp in qps:
                qp.close()
        for region in self._regions.all():
            self._on_unregister(region)
        if self._dev is not None:
            self._dev.close()

    def grant(self, region: Any, ranges: Any, mode: str, ttl_s: float | None = None) -> Any:
        """Not narrowed here: an rkey opens its whole memory region, for the access flags
        it was registered with, until deregistered; a memory region per grant (pinning,
        NIC tables) costs more than a request can pay (docs/transfer.md, "Capabilities")."""
        raise ValueError("grant: rdma cannot narrow a registered region; use its descriptor")

    def _on_register(self, region: Region) -> None:
        region.extra["mr"] = self._device_or_fail().register(region.addr, region.length)

    def _on_unregister(self, region: Region) -> None:
        mr = region.extra.pop("mr", None)
        if mr is not None:
            mr.close()

    def _descriptor(self, region: Region) -> RegionDescriptor:
        mr = region.extra["mr"]
        return RegionDescriptor(
            "rdma", self._engine_id, region.region_id, region.length, region.token.hex(),
            addr=region.addr, rkey=mr.rkey,
        )  # fmt: skip

    # -- queue pairs -------------------------------------------------------------------

    def _device_or_fail(self) -> VerbsDevice:
        if self._dev is None:
            raise RuntimeError("rdma: device is not open")
        return self._dev

    def _new_qp(self) -> tuple[Any, QpInfo]:
        qp, info = self._device_or_fail().new_qp()
        self._credits[qp.qp_num] = asyncio.Semaphore(self._max_send_wr)
        return qp, info

    async def accept_peer(self, request: dict[str, Any]) -> dict[str, Any]:
        """Serve a peer's QP exchange (the service calls this from its NATS handler)."""
        self._require_running("accept_peer")
        exchange = QpExchange.from_dict(request)
        try:
            self._regions.check(exchange.region_id, bytes.fromhex(exchange.token or "00" * 16),
                                0, 0)  # fmt: skip
        except AccessRefused as exc:
            self._log.warning("rdma peer refused", peer=exchange.engine_id, reason=exc.detail)
            raise ValueError(f"token: {exc.reason}") from None
        for qp in self._accepted.pop(exchange.engine_id, []):
            qp.close()  # a reconnecting peer replaces its old QPs
        qps, infos = [], []
        for remote in exchange.qps:
            qp, info = self._new_qp()
            self._device_or_fail().to_rts(qp, info, remote)
            qps.append(qp)
            infos.append(info)
        self._accepted[exchange.engine_id] = qps
        self._log.info("rdma peer connected", peer=exchange.engine_id, qps=len(qps))
        return QpExchange(self._engine_id, tuple(infos)).to_dict()

    async def _qps(self, remote: RegionDescriptor) -> list[Any]:
        peer = remote.endpoint
        link, qps = self._links.get(peer, (Link(peer), []))
        if link.usable:
            return qps
        # One exchange per peer at a time; batches that raced here reuse its result.
        async with self._connect_locks.setdefault(peer, asyncio.Lock()):
            link, qps = self._links.get(peer, (Link(peer), []))
            return qps if link.usable else await self._connect(remote, link, qps)

    async def _connect(self, remote: RegionDescriptor, link: Link, old: list[Any]) -> list[Any]:
        peer = remote.endpoint
        for qp in old:
            self._credits.pop(qp.qp_num, None)
            qp.close()
        link.move(LinkState.CONNECTING)
        self._links[peer] = (link, [])
        pairs: list[tuple[Any, QpInfo]] = []
        try:
            for _ in range(self._nqps):
                pairs.append(self._new_qp())
            request = QpExchange(self._engine_id, tuple(i for _, i in pairs),
                                 remote.region_id, remote.token)  # fmt: skip
            reply = QpExchange.from_dict(await self._connect_peer(peer, request.to_dict()))
            if len(reply.qps) != len(pairs):
                raise ValueError("qps: peer answered with a different number of QPs")
            for (qp, info), theirs in zip(pairs, reply.qps, strict=True):
                self._device_or_fail().to_rts(qp, info, theirs)
        except BaseException as exc:
            for qp, _ in pairs:
                self._credits.pop(qp.qp_num, None)
                qp.close()
            link.move(LinkState.IDLE, str(exc))
            raise
        qps = [qp for qp, _ in pairs]
        link.move(LinkState.READY)
        self._links[peer] = (link, qps)
        return qps

    # -- transfers --------------------------------------------------------------------

    async def _transfer(
        self, kind: str, region: Region, remote: RegionDescriptor, ops: list[Op]
    ) -> None:
        slices = slice_ops(ops, self._slice_bytes)
        if not slices:
            return
        peer = remote.endpoint
        try:
            qps = await self._qps(remote)
        except Exception as exc:
            raise TransferError(peer, f"cannot connect: {exc}") from exc
        dev = self._device_or_fail()
        lkey = region.extra["mr"].lkey
        batch_id = next(self._batch_ids)
        future = self._batches[batch_id] = asyncio.get_running_loop().create_future()
        self._tracker.open(batch_id, len(slices))
        try:
            # The deadline covers waiting for send-queue room too: a peer that stops
            # completing must not hold a batch (or its caller) past the timeout.
            async with asyncio.timeout(self._batch_timeout_s):
                for qp, lane in zip(qps, spread(slices, len(qps)), strict=True):
                    credits = self._credits[qp.qp_num]
                    for s in lane:
                        await credits.acquire()  # never overrun the send queue
                        wr_id = self._tracker.post(batch_id, s.op_index)
                        self._wr_qp[wr_id] = qp.qp_num
                        local = (region.addr + s.local_off, s.length, lkey)
                        dev.post(qp, kind == "write", wr_id, local, remote.addr + s.remote_off,
                                 remote.rkey)  # fmt: skip
                        self._posted.set()
                await future
        except TimeoutError:
            self._fail_link(peer, qps, f"{kind} timed out")
            raise TransferError(peer, f"{kind} timed out after {self._batch_timeout_s}s") from None
        except TransferError as exc:
            # A failed work request puts the RC queue pair in the error state.
            self._fail_link(peer, qps, exc.reason)
            op = plain(ops[exc.op_index]) if 0 <= exc.op_index < len(ops) else None
            raise TransferError(peer, exc.reason, exc.op_index, op) from None
        except Exception as exc:
            self._fail_link(peer, qps, str(exc))
            raise TransferError(peer, f"{kind} failed: {exc}") from exc
        finally:
            self._batches.pop(batch_id, None)
            # A batch that did not complete (timed out, cancelled) leaves no work
            # request for the poller to wait on; a late completion is ignored.
            for wr_id in self._tracker.forget(batch_id):
                self._wr_qp.pop(wr_id, None)

    def _fail_link(self, peer: str, qps: list[Any], reason: str) -> None:
        """Move the peer's link to the error state, unless it was reconnected meanwhile
        (this batch's queue pairs are not the link's any more)."""
        link, current = self._links[peer]
        if link.usable and current is qps:
            link.move(LinkState.ERROR, reason)

    async def _poll(self) -> None:
        idle_spins = 0
        while True:
            if not self._tracker.outstanding:
                self._posted.clear()
                await self._posted.wait()
            completions = self._device_or_fail().poll(64)
            if not completions:
                idle_spins += 1
                await asyncio.sleep(0 if idle_spins < 64 else 0.0002)
                continue
            idle_spins = 0
            for wr_id, ok, status in completions:
                self._complete(wr_id, ok, status)
            await asyncio.sleep(0)

    def _complete(self, wr_id: int, ok: bool, status: int) -> None:
        qpn = self._wr_qp.pop(wr_id, None)
        if qpn is not None and qpn in self._credits:
            self._credits[qpn].release()
        done = self._tracker.complete(wr_id, ok, f"completion status {status}")
        if done is None:
            return
        batch_id, batch = done
        future = self._batches.get(batch_id)
        if future is None or future.done():
            return
        if batch.error is None:
            future.set_result(None)
        else:
            future.set_exception(TransferError("rdma peer", batch.error, batch.op_index))
