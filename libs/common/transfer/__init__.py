"""Tandem's transfer engine: bulk KV bytes between registered memory regions.

One interface (`TransferEngine`, engine.py), three transports chosen at start-up:
tcp (tcp.py), shm (shm.py), rdma (rdma.py). Build one with `create_engine`.
"""

from .descriptor import RegionDescriptor
from .engine import EngineState, TransferEngine
from .errors import RegionBusy, TransferError
from .registry import create_engine, default_transport, rdma_available

__all__ = [
    "EngineState",
    "RegionBusy",
    "RegionDescriptor",
    "TransferEngine",
    "TransferError",
    "create_engine",
    "default_transport",
    "rdma_available",
]
