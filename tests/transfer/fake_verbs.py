"""A fake of the pyverbs surface rdma.py uses, for running its logic without a device.

The "NIC" is a dict rkey -> (addr, length) shared by every fake context in the test:
post_send checks the rkey and bounds like hardware does, copies with ctypes.memmove
at once and queues a work completion. It proves the engine's flow (exchange, QP
state, slicing, completion accounting), not verbs itself: that is test_rdma_device.
"""

from __future__ import annotations

import ctypes
import itertools
from types import SimpleNamespace
from typing import Any

SUCCESS, REM_ACCESS_ERR = 0, 10
E = SimpleNamespace(
    IBV_QPT_RC=2, IBV_ACCESS_LOCAL_WRITE=1, IBV_ACCESS_REMOTE_WRITE=2, IBV_ACCESS_REMOTE_READ=4,
    IBV_WR_RDMA_WRITE=0, IBV_WR_RDMA_READ=4, IBV_SEND_SIGNALED=2, IBV_WC_SUCCESS=SUCCESS,
)  # fmt: skip


def make_verbs() -> SimpleNamespace:
    fabric: dict[int, tuple[int, int]] = {}
    qps: dict[int, Any] = {}
    keys = itertools.count(0x100)

    class Closable:
        def close(self) -> None:
            pass

    class Context(Closable):
        def __init__(self, name: str) -> None:
            self.name = name

        def query_port(self, port: int) -> Any:
            return SimpleNamespace(lid=7, active_mtu=5)

        def query_gid(self, port: int, index: int) -> Any:
            return SimpleNamespace(gid="fe80:0000:0000:0000:0000:0000:0000:0001")

    class PD(Closable):
        def __init__(self, ctx: Context) -> None:
            pass

    class CQ(Closable):
        def __init__(self, ctx: Context, cqe: int) -> None:
            self.queue: list[Any] = []

        def poll(self, n: int) -> tuple[int, list[Any]]:
            out, self.queue = self.queue[:n], self.queue[n:]
            return len(out), out

    class MR:
        def __init__(self, pd: PD, length: int, access: int, address: int) -> None:
            self.lkey = self.rkey = next(keys)
            fabric[self.rkey] = (address, length)

        def close(self) -> None:
            fabric.pop(self.rkey, None)

    class QP:
        def __init__(self, pd: PD, attr: Any) -> None:
            self.qp_num, self.cq, self.state, self.peer = next(keys), attr.scq, "reset", None
            qps[self.qp_num] = self

        def to_rts(self, attr: Any) -> None:
            self.state, self.peer = "rts", attr.dest_qp_num

        def post_send(self, wr: Any) -> None:
            if self.state != "rts" or self.peer not in qps:
                raise RuntimeError("post_send on a QP that is not connected")
            base, length = fabric.get(wr.rkey, (0, -1))
            sge = wr.sg[0]
            ok = wr.remote_addr >= base and wr.remote_addr + sge.length <= base + length
            if ok and wr.opcode == E.IBV_WR_RDMA_WRITE:
                ctypes.memmove(wr.remote_addr, sge.addr, sge.length)
            elif ok:
                ctypes.memmove(sge.addr, wr.remote_addr, sge.length)
            status = SUCCESS if ok else REM_ACCESS_ERR
            self.cq.queue.append(SimpleNamespace(wr_id=wr.wr_id, status=status))

        def close(self) -> None:
            qps.pop(self.qp_num, None)

    class SendWR:
        def __init__(self, wr_id: int, opcode: int, num_sge: int, sg: list, send_flags: int):
            self.wr_id, self.opcode, self.sg = wr_id, opcode, sg

        def set_wr_rdma(self, rkey: int, addr: int) -> None:
            self.rkey, self.remote_addr = rkey, addr

    def record(**kw: Any) -> SimpleNamespace:
        return SimpleNamespace(**kw)

    return SimpleNamespace(
        e=E, Context=Context, PD=PD, CQ=CQ, MR=MR, QP=QP, SendWR=SendWR,
        SGE=lambda addr, length, lkey: SimpleNamespace(addr=addr, length=length, lkey=lkey),
        QPCap=record, QPInitAttr=record, QPAttr=record, GlobalRoute=record, AHAttr=record,
        GID=lambda value: value,
    )  # fmt: skip
