"""Reading a QuantWeight's rows as fp32 with the kernels (embedding lookups, the slices of
a wide product, tests)."""

from __future__ import annotations

import torch

from libs.common.engine.load.quantized import QuantWeight
from libs.common.engine.model.quant.native import library


def rows(weight: QuantWeight, index: torch.Tensor) -> torch.Tensor:
    """fp32 [len(index), cols]: the rows `index` (an embedding lookup)."""
    index = index.to(torch.int64).contiguous()
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= weight.shape[0]):
        raise IndexError(f"row index out of range for {weight.shape[0]} rows")
    out = torch.empty(index.numel(), weight.cols, dtype=torch.float32)
    _dequant(weight, index.data_ptr(), 0, index.numel(), out)
    return out


def dequantize(weight: QuantWeight, start: int = 0, stop: int | None = None, out=None):
    """fp32 rows [start, stop) (all by default), into `out` when given."""
    stop = weight.shape[0] if stop is None else stop
    if out is None:
        out = torch.empty(stop - start, weight.cols, dtype=torch.float32)
    _dequant(weight, None, start, stop - start, out)
    return out


def _dequant(weight: QuantWeight, index_ptr, start: int, count: int, out: torch.Tensor) -> None:
    lib, _ = library()
    data = weight.data
    rc = lib.tq_dequant_rows(weight.type_id, data.data_ptr(), data.stride(0), weight.cols,
                             index_ptr, start, count, out.data_ptr())  # fmt: skip
    if rc != 0:
        raise ValueError(f"quantized weight: the {weight.kind} kernel refused the layout")
