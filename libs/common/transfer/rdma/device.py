"""Verbs resources of one rdma engine: device context, protection domain, one CQ, the
port's addressing, and the QP/MR/work-request calls the engine makes. Everything that
touches pyverbs objects lives here; the engine (rdma.py) keeps the policy.
"""

from __future__ import annotations

import secrets
from typing import Any

from libs.common.transfer.rdma.link import QpInfo
from libs.common.transfer.rdma.shim import load as load_pyverbs


class VerbsDevice:
    """Open with `open()`; `close()` is safe on a half-opened device."""

    def __init__(self, device: str, port_num: int, gid_index: int, max_send_wr: int) -> None:
        self.device = device
        self._port_num = port_num
        self._gid_index = gid_index
        self._max_send_wr = max_send_wr
        self.v: Any = None
        self._ctx: Any = None
        self._pd: Any = None
        self.cq: Any = None
        self._port: tuple[int, str, int] = (0, "", 0)  # lid, gid (hex), mtu

    def open(self, cqe: int, verbs: Any = None) -> None:
        v = self.v = verbs or load_pyverbs()
        self._ctx = v.Context(name=self.device)
        self._pd = v.PD(self._ctx)
        self.cq = v.CQ(self._ctx, cqe)
        port = self._ctx.query_port(self._port_num)
        gid = self._ctx.query_gid(self._port_num, self._gid_index)
        self._port = (port.lid, str(gid.gid).replace(":", ""), int(port.active_mtu))

    def close(self) -> None:
        for resource in (self.cq, self._pd, self._ctx):
            if resource is not None:
                resource.close()
        self.cq = self._pd = self._ctx = None

    @property
    def access(self) -> int:
        e = self.v.e
        return e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ

    def register(self, addr: int, length: int) -> Any:
        return self.v.MR(self._pd, length, self.access, address=addr)

    def new_qp(self) -> tuple[Any, QpInfo]:
        """An RC QP in RESET and what the peer needs to connect to it (random PSN)."""
        v = self.v
        cap = v.QPCap(max_send_wr=self._max_send_wr, max_recv_wr=1, max_send_sge=1,
                      max_recv_sge=1)  # fmt: skip
        attr = v.QPInitAttr(qp_type=v.e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap)
        qp = v.QP(self._pd, attr)
        lid, gid, mtu = self._port
        return qp, QpInfo(qp.qp_num, secrets.randbelow(1 << 24), lid, gid, mtu)

    def to_rts(self, qp: Any, local: QpInfo, remote: QpInfo) -> None:
        """RESET -> INIT -> RTR -> RTS against the peer's QP (pyverbs' to_rts walks it)."""
        v = self.v
        attr = v.QPAttr(port_num=self._port_num)
        attr.qp_access_flags = self.access
        attr.path_mtu = min(local.mtu, remote.mtu)
        attr.dest_qp_num, attr.rq_psn, attr.sq_psn = remote.qpn, remote.psn, local.psn
        attr.max_dest_rd_atomic = attr.max_rd_atomic = 16
        attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
        dgid = v.GID(":".join(remote.gid[i : i + 4] for i in range(0, 32, 4)))
        gr = v.GlobalRoute(dgid=dgid, sgid_index=self._gid_index)
        attr.ah_attr = v.AHAttr(gr=gr, is_global=1, dlid=remote.lid, port_num=self._port_num)
        qp.to_rts(attr)

    def post(self, qp: Any, write: bool, wr_id: int, local: tuple[int, int, int], raddr: int,
             rkey: int) -> None:  # fmt: skip
        """Post one signaled RDMA WRITE/READ; local is (addr, length, lkey)."""
        v, e = self.v, self.v.e
        opcode = e.IBV_WR_RDMA_WRITE if write else e.IBV_WR_RDMA_READ
        sge = v.SGE(*local)
        wr = v.SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[sge],
                      send_flags=e.IBV_SEND_SIGNALED)  # fmt: skip
        wr.set_wr_rdma(rkey, raddr)
        qp.post_send(wr)

    def poll(self, count: int) -> list[tuple[int, bool, int]]:
        """Completions as (wr_id, ok, status); never blocks."""
        n, wcs = self.cq.poll(count)
        ok = self.v.e.IBV_WC_SUCCESS
        return [(wc.wr_id, wc.status == ok, wc.status) for wc in wcs[: max(n, 0)]]
