"""Quantized weights are held on transparent huge pages where the kernel allows them
(load/quantized.py, block_storage): the pages are advised before the blocks are written, so
a decode step's reads of every weight do not pay a TLB miss each 4 KiB."""

from __future__ import annotations

import pathlib

import pytest
import torch

from libs.common.engine.load.quantized import HUGE_PAGE, QuantWeight, block_storage, stack_rows

THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_kib_at(address: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds `address`."""
    inside = False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def fallbacks() -> int:
    """Huge-page faults the kernel served with small pages (it had no free huge page)."""
    for line in pathlib.Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("thp_fault_fallback "):
            return int(line.split()[1])
    return 0


def touched_on_huge_pages(tensor: torch.Tensor, address: int) -> int:
    """Write the storage, then AnonHugePages (KiB) at `address`; a skip where the kernel
    fell back to small pages while it was written (memory too fragmented: advice refused,
    not ignored)."""
    before = fallbacks()
    tensor.fill_(7)
    if fallbacks() > before:
        pytest.skip("the kernel had no free huge page (thp_fault_fallback rose)")
    return huge_kib_at(address)


def thp_mode() -> str:
    if not THP.exists():
        pytest.skip("no transparent huge pages on this kernel")
    return THP.read_text().split("[")[1].split("]")[0]


def test_a_matrix_of_blocks_is_held_on_huge_pages_where_the_kernel_allows_them():
    if thp_mode() == "never":
        pytest.skip("transparent huge pages are off on this host (never)")
    held = block_storage(64, 256 * 1024)  # 16 MiB: at least 7 whole huge pages inside it
    address = held.data_ptr() + 8 * HUGE_PAGE // 2
    assert touched_on_huge_pages(held, address) >= HUGE_PAGE // 1024
    assert held.shape == (64, 256 * 1024) and held.dtype == torch.uint8


def test_stacked_rows_are_the_parts_rows_in_order_on_advised_storage():
    if thp_mode() == "never":
        pytest.skip("transparent huge pages are off on this host (never)")
    rows = torch.randint(0, 256, (9000, 1152), dtype=torch.uint8)  # 9.9 MB of Q4_K rows
    parts = [
        QuantWeight("Q4_K", rows[:3000].clone(), 2048),
        QuantWeight("Q4_K", rows[3000:].clone(), 2048),
    ]
    before = fallbacks()
    fused = stack_rows(parts)
    assert torch.equal(fused.data, rows) and fused.cols == 2048
    if fallbacks() > before:
        pytest.skip("the kernel had no free huge page (thp_fault_fallback rose)")
    assert huge_kib_at(fused.data.data_ptr() + fused.data.numel() // 2) >= HUGE_PAGE // 1024
