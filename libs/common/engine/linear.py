"""Matrix products with weights kept in the layout that reads fastest per device.

Measured on the 2-core CPU dev machines (30 layers of the default model plus its
lm_head, fp32): torch's dense `F.linear` reads ~9.5 GB/s at batch 1; the same
weights as oneDNN (mkldnn) tensors read ~17 GB/s at batch 1 and are ~20%
faster at batch 32. So on the CPU each weight is converted once to an mkldnn
tensor; elsewhere (CUDA) a plain `F.linear` is best.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mkldnn_usable(device: torch.device) -> bool:
    return device.type == "cpu" and torch.backends.mkldnn.is_available()


class Linear:
    """y = x @ W^T + b for a fixed weight [out, in].

    Contract: `__call__` takes x [T, in] (any T, contiguous or not) and returns
    a dense contiguous [T, out] tensor of x's dtype. The weight is not a
    parameter: this is inference only.
    """

    __slots__ = ("_bias", "_fn", "_weight", "in_features", "out_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self._bias = bias
        if mkldnn_usable(weight.device) and weight.dtype == torch.float32:
            self._weight = weight.contiguous().to_mkldnn()
            self._fn = self._mkldnn
        else:
            self._weight = weight.contiguous()
            self._fn = self._dense

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._fn(x)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self._weight, self._bias)

    def _mkldnn(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), self._weight).to_dense()
        if self._bias is not None:
            y += self._bias
        return y
