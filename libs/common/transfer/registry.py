"""Transport registry: names -> engine classes, imported only when chosen.

pyverbs is imported only by the rdma engine, and only when a service picks rdma, so
machines without rdma-core never touch it.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import MappingProxyType
from typing import Any

from libs.common.transfer.engine import TransferEngine

TRANSPORTS = MappingProxyType(
    {
        "tcp": ("libs.common.transfer.tcp.engine", "TcpTransferEngine"),
        "shm": ("libs.common.transfer.shm.engine", "ShmTransferEngine"),
        "rdma": ("libs.common.transfer.rdma.engine", "RdmaTransferEngine"),
    }
)


def rdma_devices(sys_dir: str = "/sys/class/infiniband") -> list[str]:
    """Names of the RDMA devices the kernel knows (empty where there are none)."""
    path = Path(sys_dir)
    return sorted(p.name for p in path.iterdir()) if path.is_dir() else []


def rdma_available() -> bool:
    """A device exists and pyverbs can be imported (checked without importing it)."""
    return bool(rdma_devices()) and importlib.util.find_spec("pyverbs") is not None


def default_transport() -> str:
    """rdma where a device exists, else tcp (docs/transfer.md)."""
    return "rdma" if rdma_available() else "tcp"


def create_engine(transport: str | None = None, **options: Any) -> TransferEngine:
    """Build (not start) the engine for `transport`; None or "auto" picks the default.

    `options` go to the engine's constructor (see TcpTransferEngine, ShmTransferEngine,
    RdmaTransferEngine); an unknown option is a TypeError from that constructor.
    """
    name = default_transport() if transport in (None, "auto") else transport
    if name not in TRANSPORTS:
        raise ValueError(f"transport: {name!r} is not one of {sorted(TRANSPORTS)} or 'auto'")
    module_name, class_name = TRANSPORTS[name]
    engine_class = getattr(importlib.import_module(module_name), class_name)
    return engine_class(**options)
