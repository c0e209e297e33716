"""Import pyverbs through one place, whatever rdma-core version provides it.

Debian's python3-pyverbs (rdma-core 44) has a flat `pyverbs.enums` module
(`enums.IBV_QPT_RC`); rdma-core >= 50 replaced it with `pyverbs.libibverbs_enums`,
whose constants live in enum classes (`ibv_qp_type.IBV_QPT_RC`). `load_enums` gives
the rdma engine the same flat namespace of ints from either. Only rdma.py imports
this module, and only when the rdma transport is chosen.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType, SimpleNamespace

# Constant -> its enum class in rdma-core >= 50.
ENUMS = MappingProxyType(
    {
        "IBV_QPT_RC": "ibv_qp_type",
        "IBV_ACCESS_LOCAL_WRITE": "ibv_access_flags",
        "IBV_ACCESS_REMOTE_WRITE": "ibv_access_flags",
        "IBV_ACCESS_REMOTE_READ": "ibv_access_flags",
        "IBV_WR_RDMA_WRITE": "ibv_wr_opcode",
        "IBV_WR_RDMA_READ": "ibv_wr_opcode",
        "IBV_SEND_SIGNALED": "ibv_send_flags",
        "IBV_WC_SUCCESS": "ibv_wc_status",
    }
)


def load_enums() -> SimpleNamespace:
    """The verbs constants the engine uses, as plain ints; ImportError without pyverbs."""
    try:
        new = importlib.import_module("pyverbs.libibverbs_enums")
        return SimpleNamespace(
            **{name: int(getattr(getattr(new, cls), name)) for name, cls in ENUMS.items()}
        )
    except (ImportError, AttributeError):
        old = importlib.import_module("pyverbs.enums")
        return SimpleNamespace(**{name: int(getattr(old, name)) for name in ENUMS})


def load() -> SimpleNamespace:
    """The pyverbs classes the rdma engine uses, plus `e` (load_enums)."""
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.cq import CQ
    from pyverbs.device import Context
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, SendWR

    return SimpleNamespace(
        e=load_enums(), GID=GID, AHAttr=AHAttr, GlobalRoute=GlobalRoute, CQ=CQ,
        Context=Context, MR=MR, PD=PD, QP=QP, QPAttr=QPAttr, QPCap=QPCap,
        QPInitAttr=QPInitAttr, SGE=SGE, SendWR=SendWR,
    )  # fmt: skip
