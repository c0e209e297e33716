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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
        if onednn_usable(weight.device) and weight.dtype == torch.float32:
            self._weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
            self._fn = self._onednn
        else:
            self._weight = weight.contiguous()
            self._fn = self._dense

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._fn(x)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self._weight, self._bias)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._weight, self._bias,
                                                  "none", [], "")  # fmt: skip
