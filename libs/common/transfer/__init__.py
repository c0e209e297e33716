"""Tandem's transfer engine: bulk KV bytes between registered memory regions.

One interface (`TransferEngine`, engine.py), three transports chosen at start-up:
tcp/, shm/ and rdma/ (each a package). Build one with `create_engine`.

May import: the standard library, numpy, libs.common.log; rdma/exchange also the bus.
"""

from libs.common.transfer.descriptor import RegionDescriptor
from libs.common.transfer.engine import EngineState, TransferEngine
from libs.common.transfer.errors import RegionBusy, TransferError
from libs.common.transfer.registry import create_engine, default_transport, rdma_available

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
