"""The element-wise parts of a layer as single passes: RMSNorm (with the residual add
fused in), rotate-half RoPE and SwiGLU, and the sampler's argmax. The C kernels
(quant/kernels.c) on the CPU, torch elsewhere or when no kernel build is available.

A decode step of one stream is mostly small ops: torch's `F.rms_norm` runs five of them
(~20 us on these hosts), RoPE six, SwiGLU three; each kernel is one pass of a few us.
Both sides compute the same fp32 formulas (x / sqrt(mean(x^2) + eps) * w;
x * cos + rotate_half(x) * sin; silu(gate) * up).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from libs.common.engine.model.quant.native import optional_library


def _kernels(x: torch.Tensor) -> ctypes.CDLL | None:
    """The kernel build, if x is a dense fp32 CPU tensor and there is one to run on it."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous():
        return optional_library()
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [T, D] with weight [D]."""
    lib = _kernels(x)
    if lib is None:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    out = torch.empty_like(x)
    lib.tq_rms_norm(x.data_ptr(), None, weight.data_ptr(), eps, x.shape[0], x.shape[1],
                    out.data_ptr())  # fmt: skip
    return out


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x + delta (x is updated in place when it can be) and the RMSNorm of that sum."""
    lib = _kernels(x)
    if lib is None or _kernels(delta) is None:
        x = x + delta
        return x, F.rms_norm(x, (x.shape[-1],), weight, eps)
    out = torch.empty_like(x)
    lib.tq_rms_norm(x.data_ptr(), delta.data_ptr(), weight.data_ptr(), eps, x.shape[0],
                    x.shape[1], out.data_ptr())  # fmt: skip
    return x, out


def swiglu(gate_up: torch.Tensor, size: int) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2 * size] = gate | up."""
    lib = _kernels(gate_up)
    if lib is None:
        gate, up = gate_up.split(size, dim=-1)
        return F.silu(gate) * up
    out = gate_up.new_empty(gate_up.shape[0], size)
    lib.tq_swiglu(gate_up.data_ptr(), size, gate_up.shape[0], out.data_ptr())
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, H, D] (heads dense in each token's row; rows may be
    strided, as q|k inside the fused qkv output) with cos/sin [T, 1, D]."""
    t, h, d = x.shape
    dense_rows = x.stride(2) == 1 and x.stride(1) == d
    lib = _kernels(cos) if dense_rows else None
    if (lib is None or _kernels(sin) is None or x.dtype != torch.float32
            or x.device.type != "cpu"):  # fmt: skip
        half = d // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
    out = x.new_empty(t, h, d)
    lib.tq_rope(x.data_ptr(), x.stride(0), h, d, cos.data_ptr(), sin.data_ptr(), t,
                out.data_ptr())  # fmt: skip
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value ([rows, n] -> [rows] int64; the first of equal
    ones, a NaN the largest): torch.argmax(x, dim=-1). On the CPU torch takes ~8 ms for
    4-32 rows of the default model's logits (one row: 0.05 ms); the kernel ~0.1 ms."""
    lib = _kernels(x)
    if lib is None or x.dim() != 2 or x.shape[1] <= 0:
        return torch.argmax(x, dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.tq_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out
