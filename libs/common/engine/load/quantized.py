"""A matrix kept in one of GGUF's quantized block formats, as the file stores it.

Each of the `rows` rows is `cols / block_size` blocks of `block_bytes` bytes (llama.cpp's
layouts: Q4_0, Q4_1, Q8_0 with 32 values a block; Q4_K, Q5_K, Q6_K with 256). The bytes
are held in a uint8 tensor [rows, row_bytes]; rows can be permuted, sliced and stacked
without touching a block, which is all loading needs (llama's Q/K row order, fused q|k|v).
The kernels that read them are in engine/model/quant.
"""

from __future__ import annotations

import dataclasses
import mmap
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# GGML type ids (the file's tensor types) -> (values a block, bytes a block).
FORMATS: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
}


@dataclasses.dataclass(frozen=True)
class QuantWeight:
    """A [rows, cols] matrix in the block format `kind`; `data` is uint8 [rows, row_bytes]."""

    kind: str
    data: torch.Tensor
    cols: int

    def __post_init__(self) -> None:
        if self.kind not in FORMATS:
            raise ValueError(f"quantized weight: unsupported format {self.kind}")
        _, block, nbytes = FORMATS[self.kind]
        if self.cols % block or str(self.data.dtype) != "torch.uint8" or self.data.dim() != 2:
            raise ValueError(f"quantized weight: bad {self.kind} layout for {self.cols} columns")
        if self.data.shape[1] != self.cols // block * nbytes:
            need = self.cols // block * nbytes
            raise ValueError(
                f"quantized weight: {self.data.shape[1]} bytes a row, {self.kind} x "
                f"{self.cols} needs {need}"
            )

    @property
    def type_id(self) -> int:
        return FORMATS[self.kind][0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.cols)

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def stack_rows(parts: list[QuantWeight]) -> QuantWeight:
    """One weight whose rows are the parts' rows in order (all of one format and width)."""
    first = parts[0]
    if any(p.kind != first.kind or p.cols != first.cols for p in parts):
        raise ValueError("stack_rows: parts differ in format or width")
    import torch

    out = block_storage(sum(p.data.shape[0] for p in parts), first.data.shape[1])
    return QuantWeight(first.kind, torch.cat([p.data for p in parts], out=out), first.cols)


# The size of a transparent huge page on x86-64 (and ARM64's usual 4 KiB granule).
HUGE_PAGE = 2 << 20


def block_storage(rows: int, row_bytes: int) -> torch.Tensor:
    """Uninitialised uint8 [rows, row_bytes] for a matrix's blocks, on pages of its own that
    are advised to be huge (transparent huge pages, where the kernel allows them) before
    anything touches them. A decode step reads every weight once from memory; on 4 KiB
    pages each 4 KiB of weights costs a TLB miss and the hardware prefetcher restarts at
    each page (docs/engine.md, "Reading the weights"). A mapping of its own, not the
    allocator's: in a process that has freed large buffers, malloc hands back pages already
    touched, which stay small whatever the advice. Advice only: where it is refused, or
    below a huge page, the storage is the same on small pages."""
    import torch

    nbytes = rows * row_bytes
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty((rows, row_bytes), dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages
        pass
    # the tensor holds the mapping: it is unmapped with the last tensor that shares it
    return torch.frombuffer(region, dtype=torch.uint8).view(rows, row_bytes)
