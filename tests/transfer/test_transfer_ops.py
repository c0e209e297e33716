"""Op validation, slicing and spreading: the pure checks every transport shares."""

from __future__ import annotations

import pytest

from libs.common.transfer.ops import (
    Op,
    Slice,
    check_range,
    slice_ops,
    slice_size,
    spread,
    validate_ops,
)


def test_check_range_is_overflow_safe() -> None:
    assert check_range(0, 10, 10)
    assert check_range(10, 0, 10)
    assert not check_range(11, 0, 10)
    assert not check_range(5, 6, 10)
    assert not check_range((1 << 64) - 1, 2, 10)  # would wrap in 64-bit C arithmetic
    assert not check_range(2, (1 << 64) - 1, 10)
    assert not check_range(-1, 1, 10)
    assert not check_range(0, -1, 10)


@pytest.mark.parametrize(
    "op, match",
    [
        ((0, 0, -1), "negative"),
        ((-4, 0, 1), "negative"),
        ((0, 0, 1 << 64), "64 bits"),
        ((0, 60, 8), "remote range"),
        ((95, 0, 8), "local range"),
        ((0, 0, 1.5), "integers"),
        ((0, True, 1), "integers"),
        ((0, 0), "expected"),
        ("abc", "expected"),
    ],
)
def test_validate_ops_names_the_bad_op(op: object, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        validate_ops([(0, 0, 1), op], local_length=100, remote_length=64)
    assert "ops[1]" in str(info.value)


def test_validate_ops_keeps_indices_and_zero_length_ops() -> None:
    ops = validate_ops([(0, 0, 4), (4, 4, 0), [8, 8, 4]], 16, 16)
    assert ops == [Op(0, 0, 4), Op(4, 4, 0), Op(8, 8, 4)]
    assert [s.op_index for s in slice_ops(ops, 4)] == [0, 2]


def test_slice_ops_cuts_large_ops_and_covers_every_byte() -> None:
    slices = slice_ops([Op(0, 100, 10), Op(50, 0, 3)], 4)
    assert slices == [
        Slice(0, 0, 100, 4), Slice(0, 4, 104, 4), Slice(0, 8, 108, 2), Slice(1, 50, 0, 3)
    ]  # fmt: skip
    with pytest.raises(ValueError, match="slice_bytes"):
        slice_ops([], 0)


def test_spread_balances_bytes_and_keeps_order_per_lane() -> None:
    slices = slice_ops([Op(0, 0, 40)], 4)  # ten equal slices
    lanes = spread(slices, 3)
    assert sorted(sum(s.length for s in lane) for lane in lanes) == [12, 12, 16]
    for lane in lanes:
        assert lane == sorted(lane, key=lambda s: s.local_off)
    assert spread(slice_ops([Op(0, 0, 4)], 4), 4)[1:] == [[], [], []]  # one op, one lane
    with pytest.raises(ValueError, match="lanes"):
        spread(slices, 0)


def test_slice_size_gives_every_lane_a_share_and_never_exceeds_slice_bytes() -> None:
    assert slice_size(1 << 20, 2, 1 << 20) == 1 << 19  # one 1 MiB op: two halves
    assert slice_size(64 << 20, 2, 1 << 20) == 1 << 20  # capped at slice_bytes
    odd = slice_size((1 << 20) + 3, 2, 1 << 20)
    lanes = spread(slice_ops([Op(0, 0, (1 << 20) + 3)], odd), 2)
    assert all(lanes) and sum(s.length for lane in lanes for s in lane) == (1 << 20) + 3
    assert slice_size(1, 4, 1 << 20) == 1
    with pytest.raises(ValueError, match="slice_size"):
        slice_size(0, 2, 1 << 20)
