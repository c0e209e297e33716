"""Matrix products with weights kept in the layout that reads fastest per device.

On the CPU each weight is reordered once into oneDNN's blocked layout for
inner products (`torch.ops.mkldnn._reorder_linear_weight`, no batch hint) and
multiplied with `torch.ops.mkldnn._linear_pointwise`, which takes and returns
dense tensors (the path torch's inductor uses for fp32 CPU linears). The
blocked layout measured faster than a plain `.to_mkldnn()` copy of the weight
(same values, row-major) at batch 1, batch 32 and 2048 rows, and oneDNN faster
than torch's dense `F.linear` at batch 1 and 32 (docs/engine.md, "Weight
products"). The dense-in/dense-out call matters when the cores are shared:
converting x to and from mkldnn around `mkldnn_linear` adds two OpenMP regions
per product, and on oversubscribed cores every region's barrier costs a time slice.
Elsewhere (CUDA, or a torch without oneDNN) a plain `F.linear` is used.

Weights in other forms (`make_linear` picks the class): a bf16 weight goes through the
same oneDNN product in bf16 (x rounded to bf16, the result returned as fp32); a GGUF
block-quantized weight (`QuantWeight`) goes through `QuantLinear`, which reads the blocks
as stored: a few rows of x (decode steps) take the C kernel's fused dequantize-and-dot, many
rows (a prefill) take fp32 slices of the weight dequantized into a reused buffer, each
multiplied by oneDNN/BLAS, so no full fp32 copy of the weight ever exists.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from libs.common.engine.load.quantized import QuantWeight, stack_rows
from libs.common.engine.model.quant.native import library
from libs.common.engine.model.quant.ops import dequantize


def onednn_usable(device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class Linear:
    """y = x @ W^T + b for a fixed weight [out, in].

    Contract: `__call__` takes x [T, in] (any T >= 1) and returns a dense
    [T, out] tensor of x's dtype. Inference only; the weight is not copied
    again after construction.
    """

    __slots__ = ("_bias", "_fn", "_weight", "in_features", "out_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self._bias = bias
        if onednn_usable(weight.device) and weight.dtype in (torch.float32, torch.bfloat16):
            self._weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
            self._fn = self._onednn
        else:
            self._weight = weight.contiguous()
            self._fn = self._dense

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._fn(x)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        if self._weight.dtype != x.dtype:  # bf16 weights: the product runs in bf16
            bias = None if self._bias is None else self._bias.to(self._weight.dtype)
            y = torch.ops.mkldnn._linear_pointwise(x.to(self._weight.dtype).contiguous(),
                                                   self._weight, bias, "none", [], "")  # fmt: skip
            return y.to(x.dtype)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._weight, self._bias,
                                                  "none", [], "")  # fmt: skip

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        if self._weight.dtype != x.dtype:
            bias = None if self._bias is None else self._bias.to(self._weight.dtype)
            return F.linear(x.to(self._weight.dtype), self._weight, bias).to(x.dtype)
        return F.linear(x, self._weight, self._bias)


class QuantLinear:
    """y = x @ W^T + b for a block-quantized weight [out, in] (same contract as Linear;
    x and y fp32).

    Up to `GEMV_ROWS` rows of x: the C kernel dequantizes each block once and dots it with
    every row. More rows: the weight is dequantized `_SLICE_VALUES` values at a time into a
    per-thread buffer and each slice multiplied with torch's GEMM.
    """

    GEMV_ROWS = 4
    _SLICE_VALUES = 1 << 21  # 8 MiB of fp32 a slice
    _buffers = threading.local()

    __slots__ = ("_bias", "_lib", "_weight", "in_features", "out_features")

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self._weight = weight
        self._bias = bias
        self._lib = library()[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if x.dtype != torch.float32:
            raise TypeError(f"QuantLinear takes fp32 activations, got {x.dtype}")
        rows = x.shape[0]
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        if rows <= self.GEMV_ROWS:
            w = self._weight
            self._lib.tq_gemv(w.type_id, w.data.data_ptr(), w.data.stride(0), self.out_features,
                              self.in_features, x.data_ptr(), rows, y.data_ptr(),
                              self.out_features)  # fmt: skip
        else:
            self._sliced(x, y)
        if self._bias is not None:
            y += self._bias
        return y

    def _sliced(self, x: torch.Tensor, y: torch.Tensor) -> None:
        step = max(1, self._SLICE_VALUES // self.in_features)
        buffer = getattr(self._buffers, "value", None)
        need = min(step, self.out_features) * self.in_features
        if buffer is None or buffer.numel() < need:
            buffer = self._buffers.value = torch.empty(need, dtype=torch.float32)
        for start in range(0, self.out_features, step):
            stop = min(start + step, self.out_features)
            w = dequantize(self._weight, start, stop, buffer[: (stop - start) * self.in_features])
            w = w.view(stop - start, self.in_features)
            if start == 0 and stop == self.out_features:
                torch.mm(x, w.t(), out=y)
            else:
                y[:, start:stop] = torch.mm(x, w.t())


def make_linear(weight, bias: torch.Tensor | None = None):
    """The product for a weight as loaded: QuantLinear for a QuantWeight, else Linear."""
    if isinstance(weight, QuantWeight):
        return QuantLinear(weight, bias)
    return Linear(weight, bias)


class SplitLinear:
    """Products of several weights on one x, outputs side by side (parts that cannot be
    stacked into one weight: different formats or dtypes)."""

    __slots__ = ("_parts", "in_features", "out_features")

    def __init__(self, parts: list) -> None:
        self._parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self._parts], dim=-1)


def fused_linear(weights: list, bias: torch.Tensor | None = None):
    """One product for weights stacked by rows (q|k|v, gate|up): a single weight when
    they share a form, else a SplitLinear (the bias, if any, split to match)."""
    if all(isinstance(w, QuantWeight) for w in weights):
        if len({(w.kind, w.cols) for w in weights}) == 1:
            return QuantLinear(stack_rows(weights), bias)
    elif all(isinstance(w, torch.Tensor) for w in weights):
        if len({w.dtype for w in weights}) == 1:
            return Linear(torch.cat(weights), bias)
    sizes = [w.shape[0] for w in weights]
    biases = [None] * len(weights) if bias is None else list(bias.split(sizes))
    return SplitLinear([make_linear(w, b) for w, b in zip(weights, biases, strict=True)])
