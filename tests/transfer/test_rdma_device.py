"""rdma transport on a real device: loopback between two engines of one process."""

from __future__ import annotations

import os

import pytest

from libs.common.transfer import TransferError
from libs.common.transfer.descriptor import RegionDescriptor

pytestmark = pytest.mark.rdma


async def test_rdma_write_and_read_loopback() -> None:
    from libs.common.transfer.rdma.engine import RdmaTransferEngine

    engines: dict[str, RdmaTransferEngine] = {}

    async def connect_peer(endpoint: str, request: dict) -> dict:
        return await engines[endpoint].accept_peer(request)  # NATS in a service

    a = RdmaTransferEngine(connect_peer=connect_peer)
    b = RdmaTransferEngine(connect_peer=connect_peer)
    async with a, b:
        engines[a.endpoint], engines[b.endpoint] = a, b
        src, dst = a.allocate(4 << 20), b.allocate(4 << 20)
        payload = os.urandom(4 << 20)
        src[:] = payload
        d_src, d_dst = a.register(src), b.register(dst)
        await a.write(d_src, d_dst, [(0, 0, 3 << 20), (3 << 20, 3 << 20, 1 << 20)])
        assert dst == payload
        src[:] = bytes(4 << 20)
        await a.read(d_src, d_dst, [(0, 0, 4 << 20)])
        assert src == payload
        forged = RegionDescriptor.from_dict({**d_dst.to_dict(), "rkey": d_dst.rkey ^ 1})
        with pytest.raises(TransferError):
            await a.write(d_src, forged, [(0, 0, 16)])
