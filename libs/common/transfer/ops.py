"""Ops of a batch: validation, slicing into wire-sized pieces, spreading over connections.

An op is `(local_offset, remote_offset, length)`, offsets relative to the start of
each region. Everything here is pure: every transport runs the same checks, and the
server side runs `check_range` again on what arrives from the network.

    op 0 (local 0, remote 4 MiB, 3 MiB), slice_bytes = 1 MiB, 2 connections:

    slices: [0: 0..1M] [0: 1M..2M] [0: 2M..3M]
    spread:  conn A <- slice 0, slice 2     conn B <- slice 1
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from libs.common.transfer.descriptor import U64_MAX


class Op(NamedTuple):
    local_off: int
    remote_off: int
    length: int


class Slice(NamedTuple):
    """A contiguous piece of one op; `op_index` points back at the caller's op."""

    op_index: int
    local_off: int
    remote_off: int
    length: int


def check_range(offset: int, length: int, region_length: int) -> bool:
    """True when [offset, offset+length) lies inside a region of `region_length` bytes.

    Written so that it holds for any integers, including values decoded from u64
    fields that would overflow a C `offset + length`.
    """
    if offset < 0 or length < 0 or region_length < 0:
        return False
    return offset <= region_length and length <= region_length - offset


def plain(op: Sequence[int]) -> tuple[int, int, int]:
    """`op` as a plain (local_off, remote_off, length) tuple: how a TransferError names it."""
    local_off, remote_off, length = op
    return (local_off, remote_off, length)


def _as_int(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def validate_ops(ops: Iterable[Sequence[int]], local_length: int, remote_length: int) -> list[Op]:
    """Check every op against both regions; raise ValueError naming the first bad op.

    The result keeps the caller's indices (zero-length ops stay and simply produce no
    slices), so errors can name the op. An empty batch completes at once.
    """
    out: list[Op] = []
    for index, raw in enumerate(ops):
        shaped = type(raw) is tuple or type(raw) is list  # the usual case, checked cheaply
        if not shaped and (not isinstance(raw, Sequence) or isinstance(raw, str | bytes)):
            raise ValueError(f"ops[{index}]: expected (local_off, remote_off, length)")
        if len(raw) != 3:
            raise ValueError(f"ops[{index}]: expected (local_off, remote_off, length)")
        local_off: int | None
        remote_off: int | None
        length: int | None
        local_off, remote_off, length = raw
        if not (type(local_off) is int and type(remote_off) is int and type(length) is int):
            local_off, remote_off, length = (_as_int(v) for v in raw)
            if local_off is None or remote_off is None or length is None:
                raise ValueError(f"ops[{index}]: offsets and length must be integers, got {raw!r}")
        if length < 0 or local_off < 0 or remote_off < 0:
            raise ValueError(f"ops[{index}]: negative offset or length {tuple(raw)}")
        # Python ints do not overflow, and both region lengths fit 64 bits, so in-range
        # ops fit the wire's u64 fields too.
        if local_off + length > local_length or remote_off + length > remote_length:
            op = Op(local_off, remote_off, length)
            raise ValueError(_range_error(index, op, local_length, remote_length))
        out.append(Op(local_off, remote_off, length))
    return out


def _range_error(index: int, op: Op, local_length: int, remote_length: int) -> str:
    local_off, remote_off, length = op
    if max(op) > U64_MAX:
        return f"ops[{index}]: value does not fit 64 bits {tuple(op)}"
    if not check_range(local_off, length, local_length):
        return (
            f"ops[{index}]: local range {local_off}+{length} exceeds the local region "
            f"({local_length} bytes)"
        )
    return (
        f"ops[{index}]: remote range {remote_off}+{length} exceeds the remote region "
        f"({remote_length} bytes)"
    )


def batch_bytes(ops: Sequence[Op]) -> int:
    """The bytes a batch moves (one op, the usual small batch, without a generator)."""
    return ops[0].length if len(ops) == 1 else sum(op.length for op in ops)


def slice_ops(ops: Sequence[Op], slice_bytes: int) -> list[Slice]:
    """Cut ops into slices of at most `slice_bytes`, in op order."""
    if slice_bytes <= 0:
        raise ValueError(f"slice_bytes: must be positive, got {slice_bytes}")
    if len(ops) == 1 and 0 < ops[0].length <= slice_bytes:  # the usual small batch
        op = ops[0]
        return [Slice(0, op.local_off, op.remote_off, op.length)]
    slices: list[Slice] = []
    for index, op in enumerate(ops):
        done = 0
        while done < op.length:
            n = min(slice_bytes, op.length - done)
            slices.append(Slice(index, op.local_off + done, op.remote_off + done, n))
            done += n
    return slices


def slice_size(total: int, lanes: int, slice_bytes: int) -> int:
    """Slice length that gives each of `lanes` connections a share of `total` bytes.

    At most `slice_bytes`; a batch smaller than lanes x slice_bytes is cut into
    `lanes` near-equal slices, so one 1 MiB op over 2 connections moves as two
    512 KiB halves in parallel instead of one serial stream.
    """
    if total <= 0 or lanes <= 0 or slice_bytes <= 0:
        raise ValueError(
            f"slice_size: needs positive arguments, got {total}, {lanes}, {slice_bytes}"
        )
    return max(1, min(slice_bytes, -(-total // lanes)))


def spread(slices: Sequence[Slice], lanes: int) -> list[list[Slice]]:
    """Assign slices to `lanes` connections, balancing bytes, keeping order per lane.

    Greedy least-loaded: with equal slices this is round robin; a batch of one small
    op uses one lane (one ack), which keeps small-op latency at one round trip.
    """
    if lanes <= 0:
        raise ValueError(f"lanes: must be positive, got {lanes}")
    out: list[list[Slice]] = [[] for _ in range(lanes)]
    loads = [0] * lanes
    for s in slices:
        lane = loads.index(min(loads))
        out[lane].append(s)
        loads[lane] += s.length
    return out
