"""A decode step's whole layer stack in C: one kernel call per layer instead of ~15 ops.

At one stream a decode step of the default model is ~6 ms of weight products and, before
this, ~3 ms of per-op dispatch (Python, torch, ctypes) around them. `FusedDecode` runs
each layer as `tq_decode_layer` (quant/decode_layer.h): RMSNorm, q|k|v, RoPE, the K/V writes
into pages and mirror, attention over the mirror, o, the residual RMSNorm, gate|up,
SwiGLU, down and the residual add, the same kernels in the same order as the Python path
(model.py with the torch backend's kernel path), so the results are the same bits.

It applies when the model qualifies (every layer dense with quantized q|k|v, o, gate|up
and down, no q/k norms, no biases) and the step does (`TorchAttention.fused_decode`: a
decode-only step of at most `QuantLinear.GEMV_ROWS` rows, every row continuing its mirror
slot); otherwise the model runs its layers one op at a time, as before.
"""

from __future__ import annotations

import ctypes

import torch

from libs.common.engine.model.linear import QuantLinear
from libs.common.engine.model.quant.native import optional_library

_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class _Matrix(ctypes.Structure):
    _fields_ = [("type", _I), ("w", _P), ("row_bytes", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Matrix), ("o", _Matrix), ("gate_up", _Matrix), ("down", _Matrix),
                ("attn_norm", _P), ("ffn_norm", _P), ("eps", _F), ("hidden", _I), ("hq", _I),
                ("hk", _I), ("d", _I), ("inter", _I)]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [("cos", _P), ("sin", _P), ("k_pages", _P), ("v_pages", _P),
                ("layer_stride", _I64), ("kv_type", _I), ("paged_index", _P),
                ("mirror_k", _P), ("mirror_v", _P), ("mirror_layer_stride", _I64),
                ("n_mirror", _I), ("mirror_src", _P), ("mirror_dst", _P),
                ("slot_stride", _I64), ("head_stride", _I64), ("slots", _P), ("lens", _P),
                ("scale", _F), ("h", _P), ("qkv", _P), ("qk", _P), ("attn", _P), ("gu", _P),
                ("act", _P), ("tmp", _P)]  # fmt: skip


def _matrix(linear) -> _Matrix | None:
    if not isinstance(linear, QuantLinear):
        return None
    w = linear.weight
    return _Matrix(w.type_id, w.data.data_ptr(), w.data.stride(0))


class FusedDecode:
    """Built once per model; `run(x, cos, sin, attn, plan)` returns False (x untouched)
    when this step does not qualify."""

    def __init__(self, lib, layers: list[_Layer], keep: list) -> None:
        self._lib = lib
        self._layers = [ctypes.pointer(layer) for layer in layers]
        self._keep = keep  # the tensors the structs point into
        first = layers[0]
        self._widths = {"h": first.hidden, "qkv": (first.hq + 2 * first.hk) * first.d,
                        "qk": (first.hq + first.hk) * first.d, "attn": first.hq * first.d,
                        "gu": 2 * first.inter, "act": first.inter, "tmp": first.hidden}  # fmt: skip

    @classmethod
    def build(cls, model) -> FusedDecode | None:
        lib = optional_library()
        if lib is None:
            return None
        lib.tq_decode_layer.argtypes = [ctypes.POINTER(_Layer), ctypes.POINTER(_Step), _I, _P, _I]
        lib.tq_decode_layer.restype = _I
        layers: list[_Layer] = []
        keep: list[torch.Tensor] = []
        for layer in model.layers:
            dense = all(hasattr(layer.mlp, n) for n in ("gate_up", "down", "size"))  # not routed
            if layer.qk_norm is not None or not dense:
                return None
            mats = [_matrix(m) for m in (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down)]
            if None in mats or any(m.bias is not None for m in (layer.qkv, layer.o)):
                return None
            norms = (layer.attn_norm.contiguous(), layer.ffn_norm.contiguous())
            keep.extend(norms)
            layers.append(_Layer(*mats, norms[0].data_ptr(), norms[1].data_ptr(), layer.eps,
                                 layer.attn_norm.shape[0], layer.num_heads, layer.num_kv_heads,
                                 layer.head_dim, layer.mlp.size))  # fmt: skip
        return cls(lib, layers, keep)

    def run(self, x: torch.Tensor, cos, sin, attn, plan) -> bool:
        m = x.shape[0]
        if m > QuantLinear.GEMV_ROWS or not hasattr(attn, "fused_decode"):
            return False
        args = attn.fused_decode(plan)
        if args is None:
            return False
        cos, sin = cos.reshape(m, -1).contiguous(), sin.reshape(m, -1).contiguous()
        scratch = {name: torch.empty(m, w) for name, w in self._widths.items()}
        step = _Step(cos.data_ptr(), sin.data_ptr(), *args.pointers(),
                     *(t.data_ptr() for t in scratch.values()))  # fmt: skip
        ptr, step_ptr = x.data_ptr(), ctypes.pointer(step)
        run = self._lib.tq_decode_layer
        for index, layer in enumerate(self._layers):
            rc = run(layer, step_ptr, index, ptr, m)
            if rc != 0:
                raise RuntimeError(f"fused decode layer {index} failed ({rc})")
        attn.fused_done(plan)
        return True
