"""Errors of the transfer engine.

Bad arguments from the caller are `ValueError` (raised before any byte moves).
A batch that was started and did not complete raises `TransferError`: the whole
batch is failed, and the error names the peer and the op that failed.
"""

from __future__ import annotations


class AccessRefused(Exception):
    """An op was refused by the region owner's checks (region, token, bounds).

    Raised inside the engines; `reason` is safe to send back to the peer (never the
    token, never memory contents); `detail` may say more and is only logged (a TCP
    server answers an unknown region and a wrong token with the same `reason`, so a
    prober learns nothing about which regions exist, and logs which one it was).
    """

    op_index: int = -1  # the refused op, where the owner named it (tcp's ERR frame)

    def __init__(self, reason: str, detail: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail or reason


class TransferError(Exception):
    """A batch failed as a whole.

    Bytes of ops that completed before the failure may have landed; nothing was
    written outside the ranges the batch addressed. `op_index` is the index in the
    caller's op list (-1 when the failure was not specific to one op, e.g. the peer
    went away); `op` is that `(local_off, remote_off, length)` tuple or None.
    """

    def __init__(
        self,
        peer: str,
        reason: str,
        op_index: int = -1,
        op: tuple[int, int, int] | None = None,
    ) -> None:
        where = f"op {op_index} {op}" if op is not None else "the batch"
        super().__init__(f"transfer with {peer} failed at {where}: {reason}")
        self.peer = peer
        self.reason = reason
        self.op_index = op_index
        self.op = op


class RegionBusy(Exception):
    """`unregister` could not fence the region: a peer's op on it did not end in time
    (a peer process frozen mid-copy). The region is unregistered all the same, but its
    memory may still be written: do not reuse it (the decode worker retires the pages)."""
