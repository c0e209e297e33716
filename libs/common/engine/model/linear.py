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
as stored with the C kernels of quant/kernels.c: no full fp32 copy of the weight exists.
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

    @property
    def nbytes(self) -> int:
        """Bytes of weight one product reads."""
        return self.in_features * self.out_features * self._weight.element_size()

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


# Formats whose products take x as 16-bit integers in the AVX2 / AVX-512 builds (every
# block format: the K-quants' 32-value sub-blocks take x's rounding as Q4_0's blocks do).
X16_FORMATS = frozenset({"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"})
# Formats the int16 panels (tq_panel_products) multiply for any batch of 5+ rows.
PANEL_FORMATS = frozenset({"Q4_0", "Q4_1", "Q8_0"})
# Formats the panels multiply above GEMM_ROWS only (tq_gemm_panel, a prefill chunk): up to
# GEMM_ROWS their integer sub-block dots keep a row's bits the same in any decode batch.
WIDE_PANEL_FORMATS = frozenset({"Q4_K", "Q5_K", "Q6_K"})
# Row counts of x whose products take one path each (QuantLinear.GEMV_ROWS, GEMM_ROWS): a
# row's bits do not depend on the batch it is in within a class.
ROW_CLASSES = ("1-4", "5-128", ">128")


def row_class(rows: int) -> int:
    """The index in ROW_CLASSES of a product of `rows` rows."""
    if rows <= QuantLinear.GEMV_ROWS:
        return 0
    return 1 if rows <= QuantLinear.GEMM_ROWS else 2


class QuantLinear:
    """y = x @ W^T + b for a block-quantized weight [out, in] (same contract as Linear;
    x and y fp32).

    Every block format on AVX2 / AVX-512 (X16_FORMATS): x is rounded to 16-bit integers
    with a scale per 32 values and each block's (a K-quant's 32-value sub-block's) dot
    product is an integer sum. Up to `GEMV_ROWS` rows (one decode stream) `tq_gemv` reads
    the weight's blocks directly. More rows of Q4_0 / Q4_1 / Q8_0 (PANEL_FORMATS): `tq_gemm`
    unpacks 32 (AVX2: 16) weight rows at a time into an int16 panel that stays in cache and
    serves every row of x (quant/panel_products.h, panel_avx2.h; any batch size, a prefill
    too: a row has the same bits in a batch of 5 or of 2,000). More rows of K-quants, up to
    `GEMM_ROWS`: `tq_gemm` takes the same integer sub-block dots as `tq_gemv`
    (quant/kquant_products.h; a row's bits the same in any batch of 1 to `GEMM_ROWS`).
    More rows of K-quants (a prefill chunk): `tq_gemm_panel`, the int16 panels built from
    the K-quant blocks' 32-value pieces (quant/kquant_pieces.h); a candidate at 5-128 rows
    too, where the kernel choice may take it (faster from ~16 rows, slower at 5-8).

    More than `GEMM_ROWS` rows without the panels (the generic and NEON builds): the weight is
    dequantized `SLICE_VALUES` at a time into a per-thread buffer and each slice multiplied
    with torch's GEMM, whose blocking wins once the fp32 slice is reused by enough rows; x
    is rounded first as the integer path rounds it. The generic build keeps x in fp32 on
    every path.

    Those are the native paths of each row class (ROW_CLASSES); `use` can route a class
    through another candidate (`candidates`): the dequantized slices, or "copy", a oneDNN
    product on an fp32 copy of the weight made once. The engine picks them at start-up by
    measurement (model/kernel_choice.py). Every path of a class computes one function (x
    rounded alike), so they differ by fp32 summation order only.
    """

    GEMV_ROWS = 4
    GEMM_ROWS = 128
    SLICE_VALUES = 1 << 21  # 8 MiB of fp32 a slice
    _buffers = threading.local()

    __slots__ = ("_bias", "_copy", "_gemm", "_gemv", "_native", "_panel", "_paths", "_round_x",
                 "_weight", "in_features", "out_features")  # fmt: skip

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self._weight = weight
        self._bias = bias
        lib = library()[0]
        self._gemv, self._gemm, self._panel = lib.tq_gemv, lib.tq_gemm, lib.tq_gemm_panel
        # The integer products take x rounded to 16 bits a block (quant/x16_products.h): the wide
        # path rounds x the same way, so the two differ by summation order only.
        x16 = lib.tq_activation_bits() == 16 and weight.kind in X16_FORMATS
        self._round_x = lib.tq_round_x16 if x16 else None
        # int16 panels (AVX-512, and AVX2 against oneDNN's AVX2 kernels) beat the
        # dequantized slices at every batch size (docs/engine.md)
        panels = x16 and lib.tq_panel_products()
        wide = "sliced"
        if panels and weight.kind in PANEL_FORMATS:
            wide = "gemm"
        elif panels and weight.kind in WIDE_PANEL_FORMATS:
            wide = "panel"
        self._native: tuple[str, ...] = ("gemv", "gemm", wide)
        self._paths: tuple[str, ...] = self._native
        self._copy: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self._weight.nbytes

    @property
    def weight(self) -> QuantWeight:
        return self._weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self._bias

    @property
    def native_paths(self) -> tuple[str, ...]:
        """The path of each row class without a measured choice."""
        return self._native

    @property
    def paths(self) -> tuple[str, ...]:
        """The path each row class runs now."""
        return self._paths

    def candidates(self, row_class: int) -> list[str]:
        """The paths that can run `row_class` (an index into ROW_CLASSES), native first.
        1-4 rows stay on tq_gemv: the fused decode layer calls it in C, and a product of a
        few rows is bound by reading the weight, which an fp32 copy makes 4-7x larger."""
        native = self._native[row_class]
        if row_class == 0:
            return [native]
        found = [native, *(["sliced"] if native != "sliced" else [])]
        if row_class == 1 and self._native[2] == "panel":  # a K-quant with panels
            found.insert(1, "panel")
        return [*found, "copy"] if onednn_usable(torch.device("cpu")) else found

    def use(self, paths: tuple[str, ...]) -> None:
        """Run row class i through paths[i]; the fp32 copy exists while a path needs it."""
        for i, path in enumerate(paths):
            if path not in self.candidates(i):
                kind = self._weight.kind
                raise ValueError(f"{path!r} cannot run {ROW_CLASSES[i]} rows of {kind}")
        if "copy" in paths and self._copy is None:
            self._copy = self.make_copy()
        elif "copy" not in paths:
            self._copy = None
        self._paths = tuple(paths)

    def make_copy(self) -> torch.Tensor:
        """The weight dequantized to fp32, reordered for oneDNN's inner product."""
        full = dequantize(self._weight)
        return torch.ops.mkldnn._reorder_linear_weight(full, None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if x.dtype != torch.float32:
            raise TypeError(f"QuantLinear takes fp32 activations, got {x.dtype}")
        y = self.product(self._paths[row_class(x.shape[0])], x)
        if self._bias is not None:
            y += self._bias
        return y

    def product(self, path: str, x: torch.Tensor, copy: torch.Tensor | None = None):
        """x @ W^T through `path` (no bias); x contiguous fp32. `copy`: make_copy()'s
        result, for "copy" when this weight keeps none."""
        if path == "sliced":
            return self._sliced(x)
        if path == "copy":
            packed = self._copy if copy is None else copy
            if packed is None:
                raise ValueError("the copy path needs the weight's fp32 copy (use)")
            return torch.ops.mkldnn._linear_pointwise(self._rounded(x), packed, None, "none",
                                                      [], "")  # fmt: skip
        rows, w = x.shape[0], self._weight
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        kernel = {"gemv": self._gemv, "gemm": self._gemm, "panel": self._panel}[path]
        n, k = self.out_features, self.in_features
        rc = kernel(w.type_id, w.data.data_ptr(), w.data.stride(0), n, k, x.data_ptr(), rows,
                    y.data_ptr(), n)  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"quantized product failed ({rc}) for {w.kind} {w.shape}")
        return y

    def _rounded(self, x: torch.Tensor) -> torch.Tensor:
        """x as the integer products see it (rounded to 16 bits a block), else x."""
        if self._round_x is None:
            return x
        rounded = torch.empty_like(x)
        self._round_x(x.data_ptr(), x.shape[0], self.in_features, rounded.data_ptr())
        return rounded

    def _sliced(self, x: torch.Tensor) -> torch.Tensor:
        x = self._rounded(x)
        step = max(1, self.SLICE_VALUES // self.in_features)
        y = None  # a single slice's product is the result as it is (no copy)
        need = min(step, self.out_features) * self.in_features
        buffer = getattr(self._buffers, "value", None)
        if buffer is None or buffer.numel() < need:
            buffer = self._buffers.value = torch.empty(need, dtype=torch.float32)
        onednn = onednn_usable(x.device)
        for start in range(0, self.out_features, step):
            stop = min(start + step, self.out_features)
            size = (stop - start) * self.in_features
            w = dequantize(self._weight, start, stop, buffer[:size].view(stop - start, -1))
            if onednn:  # reordered per slice: ~1% of the product, which then runs 0-18% faster
                packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
                part = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            else:
                part = torch.mm(x, w.t())
            if stop - start == self.out_features:
                return part
            if y is None:
                y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
            y[:, start:stop] = part
        if y is None:  # no slice at all: out_features == 0
            return torch.empty(x.shape[0], 0, dtype=torch.float32)
        return y


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

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self._parts)

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
