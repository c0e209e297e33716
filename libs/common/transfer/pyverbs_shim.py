"""Import pyverbs through one place, whatever rdma-core version provides it.

Debian's python3-pyverbs (rdma-core 44) exposes the verbs enums as `pyverbs.enums`;
rdma-core >= 50 renamed the module `pyverbs.libibverbs_enums`. Only rdma.py imports
this module, and only when the rdma transport is chosen.
"""

from __future__ import annotations

from types import SimpleNamespace


def load() -> SimpleNamespace:
    """Return the pyverbs classes and enums the rdma engine uses; ImportError if absent."""
    try:
        from pyverbs import libibverbs_enums as enums
    except ImportError:
        from pyverbs import enums
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.cq import CQ
    from pyverbs.device import Context
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, SendWR

    return SimpleNamespace(
        e=enums, GID=GID, AHAttr=AHAttr, GlobalRoute=GlobalRoute, CQ=CQ, Context=Context, MR=MR,
        PD=PD, QP=QP, QPAttr=QPAttr, QPCap=QPCap, QPInitAttr=QPInitAttr, SGE=SGE,
        SendWR=SendWR,
    )  # fmt: skip
