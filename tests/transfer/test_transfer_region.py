"""What can be registered, and the access check every incoming op goes through."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from libs.common.transfer.errors import AccessRefused
from libs.common.transfer.region import RegionTable, buffer_view


@pytest.mark.parametrize(
    "make",
    [
        lambda: bytearray(64),
        lambda: mmap.mmap(-1, 64),
        lambda: np.zeros(16, dtype=np.float32),
        lambda: torch.zeros(32, dtype=torch.bfloat16),
        lambda: memoryview(bytearray(64)),
    ],
    ids=["bytearray", "mmap", "numpy", "torch-bf16", "memoryview"],
)
def test_buffer_view_covers_the_whole_buffer_writably(make) -> None:
    buffer = make()
    view, addr = buffer_view(buffer)
    assert view.nbytes == 64 and not view.readonly and addr != 0
    view[3] = 0x5A
    raw = buffer.view(torch.uint8)[3].item() if isinstance(buffer, torch.Tensor) else None
    assert raw in (None, 0x5A)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: b"read-only", "read-only"),
        (lambda: np.zeros((4, 4))[:, 1], "contiguous"),
        (lambda: torch.zeros(4, 4).t(), "contiguous"),
        (lambda: 42, "does not expose"),
        (lambda: bytearray(), "empty"),
    ],
)
def test_buffer_view_refuses_unusable_memory(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        buffer_view(make())


def test_region_check_refuses_unknown_region_wrong_token_and_bad_bounds() -> None:
    table = RegionTable()
    region = table.add(bytearray(100))
    assert table.check(region.region_id, region.token, 0, 100) is region
    with pytest.raises(AccessRefused, match="unknown region"):
        table.check(region.region_id + 1, region.token, 0, 1)
    with pytest.raises(AccessRefused, match="wrong token"):
        table.check(region.region_id, bytes(16), 0, 1)
    with pytest.raises(AccessRefused, match="outside"):
        table.check(region.region_id, region.token, 99, 2)
    with pytest.raises(AccessRefused, match="outside"):
        table.check(region.region_id, region.token, (1 << 64) - 1, 2)
    table.remove(region.region_id)
    with pytest.raises(AccessRefused, match="unknown region"):
        table.check(region.region_id, region.token, 0, 1)


def test_region_ids_and_tokens_are_unique_per_registration() -> None:
    table = RegionTable()
    regions = [table.add(bytearray(8)) for _ in range(50)]
    assert len({r.region_id for r in regions}) == 50
    assert len({r.token for r in regions}) == 50
