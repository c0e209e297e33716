"""RMSNorm, with the residual add fused in: the C kernel on the CPU, torch elsewhere.

A decode step normalizes a few rows 61 times (twice a layer, once at the end); torch's
`F.rms_norm` runs five ops for each (~20 us on these hosts), the kernel one pass (~2 us).
Both compute x / sqrt(mean(x^2) + eps) * w in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from libs.common.engine.model.quant.native import optional_library


def _fast(x: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.is_contiguous()
        and optional_library() is not None
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [T, D] with weight [D]."""
    if not _fast(x):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    out = torch.empty_like(x)
    optional_library().tq_rms_norm(x.data_ptr(), None, weight.data_ptr(), eps, x.shape[0],
                             x.shape[1], out.data_ptr())  # fmt: skip
    return out


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x + delta (x is updated in place when it can be) and the RMSNorm of that sum."""
    if not (_fast(x) and _fast(delta)):
        x = x + delta
        return x, F.rms_norm(x, (x.shape[-1],), weight, eps)
    out = torch.empty_like(x)
    optional_library().tq_rms_norm(x.data_ptr(), delta.data_ptr(), weight.data_ptr(), eps,
                             x.shape[0], x.shape[1], out.data_ptr())  # fmt: skip
    return x, out
