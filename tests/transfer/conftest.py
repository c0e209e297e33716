"""Fixtures of the transfer-engine tests, and the visible skip of device tests."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import pytest

from libs.common.transfer.registry import rdma_devices
from libs.common.transfer.shm.engine import ShmTransferEngine
from libs.common.transfer.tcp.engine import TcpTransferEngine


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if rdma_devices():
        return
    skip = pytest.mark.skip(reason="needs an RDMA device (none under /sys/class/infiniband)")
    for item in items:
        if "rdma" in item.keywords:
            item.add_marker(skip)


def connect_raw(endpoint: str) -> socket.socket:
    """A plain blocking socket to a TCP transfer server (a raw, maybe hostile, peer)."""
    host, port = endpoint.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.settimeout(5)
    return sock


@pytest.fixture
async def tcp_pair() -> AsyncIterator[tuple[TcpTransferEngine, TcpTransferEngine]]:
    """Two started TCP engines on 127.0.0.1, random ports; stopped after the test."""
    a = TcpTransferEngine(host="127.0.0.1", port=0, connections_per_peer=2, slice_bytes=64 << 10,
                          batch_timeout_s=10.0)  # fmt: skip
    b = TcpTransferEngine(host="127.0.0.1", port=0, batch_timeout_s=10.0)
    await a.start()
    await b.start()
    try:
        yield a, b
    finally:
        await a.stop()
        await b.stop()


@pytest.fixture
async def shm_pair(tmp_path) -> AsyncIterator[tuple[ShmTransferEngine, ShmTransferEngine]]:
    """Two started shm engines whose segments live in a per-test directory."""
    a = ShmTransferEngine(shm_dir=str(tmp_path), inline_copy_bytes=1 << 16)
    b = ShmTransferEngine(shm_dir=str(tmp_path), inline_copy_bytes=1 << 16)
    await a.start()
    await b.start()
    try:
        yield a, b
    finally:
        await a.stop()
        await b.stop()
