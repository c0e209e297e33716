"""Quantized weights: the C kernels against gguf-py's reference dequantizers, and a whole
GGUF of mixed block formats computing the same logits native and dequantized."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.load.gguf import load_gguf
from libs.common.engine.load.quantized import FORMATS, QuantWeight, stack_rows
from libs.common.engine.model.linear import QuantLinear, SplitLinear, fused_linear
from libs.common.engine.model.model import LlamaModel
from libs.common.engine.model.quant import native
from libs.common.engine.model.quant.native import VARIANTS, choose_variant, cpu_flags, library
from libs.common.engine.model.quant.ops import dequantize, rows
from tests.engine.model.test_families import make_core
from tests.engine.model.tiny_gguf import VOCAB, write_tiny_llama_gguf

gguf = pytest.importorskip("gguf")

# Where each format keeps its fp16 scales (byte offsets in a block): set to sane values,
# since random bytes there could be inf/NaN.
SCALES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
          "Q6_K": (208,)}  # fmt: skip


def random_blocks(kind: str, rows_: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, row_bytes] of random blocks with finite scales of ~1e-2."""
    _, block, nbytes = FORMATS[kind]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows_, cols // block, nbytes), dtype=np.uint8)
    for offset in SCALES[kind]:
        scales = rng.uniform(0.002, 0.02, size=data.shape[:2]).astype(np.float16)
        data[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(*data.shape[:2], 2)
    return data.reshape(rows_, -1)


def reference(kind: str, data: np.ndarray) -> torch.Tensor:
    kind_id = gguf.GGMLQuantizationType[kind]
    return torch.from_numpy(gguf.quants.dequantize(data, kind_id).astype(np.float32))


def weight(kind: str, rows_: int, cols: int, seed: int = 0) -> tuple[QuantWeight, torch.Tensor]:
    data = random_blocks(kind, rows_, cols, seed)
    return QuantWeight(kind, torch.from_numpy(data), cols), reference(kind, data)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# Every format's products take x as 16-bit integers, a scale per 32 values, in the AVX2
# and AVX-512 builds (quant/x16_products.h, quant/kquant_products.h): exactly x16(x) @ W^T
# below, up to fp32 summation order. The generic build keeps x in fp32.
X16_FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
PANEL_FORMATS = ("Q4_0", "Q4_1", "Q8_0")  # the int16 panels multiply these


def x16(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the 16-bit-activation kernels round it: per block of 32, to multiples
    of max |x| / 32767."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    # as quant/x16_products.h computes it: x * (32767 / amax), rounded (x / step can round the other
    # way at a tie: one step, ~1e-5 of a product with outliers)
    inverse = torch.where(amax > 0, 32767 / torch.where(amax > 0, amax, 1), 0)
    return (torch.round(blocks * inverse) * (amax / 32767)).reshape(x.shape)


def expected(kind: str, x: torch.Tensor, ref: torch.Tensor, lib=None) -> torch.Tensor:
    """What the kernels (the chosen build, or lib) compute for x (at most GEMM_ROWS rows)
    and the dequantized ref."""
    bits = (lib or library()[0]).tq_activation_bits()
    x = x16(x) if kind in X16_FORMATS and bits == 16 else x
    return (x.double() @ ref.double().t()).float()  # fp64: its own rounding out of the way


def test_kernels_build_for_this_cpu_and_say_which():
    lib, variant = library()
    assert variant in native.variants() and lib.tq_block_bytes(FORMATS["Q6_K"][0]) == 210
    assert choose_variant(frozenset(), machine="x86_64") == "generic"
    assert choose_variant(VARIANTS["avx2"][1] | {"avx512f"}, "x86_64") == "avx2"
    assert choose_variant(frozenset(VARIANTS["avx512"][1]), "x86_64") == "avx512"
    assert choose_variant(VARIANTS["avx512"][1] | {"avx512_vnni"}, "x86_64") == "avx512vnni"
    assert choose_variant(frozenset(VARIANTS["avx512"][1]), "aarch64") == "generic"


def test_a_cached_build_is_keyed_by_kernels_c_and_every_part_it_includes(tmp_path, monkeypatch):
    includes = re.findall(r'^#include "(.+)"$', native.SOURCE.read_text(), re.MULTILINE)
    assert [p.name for p in native.sources()[1:]] == sorted(includes)  # every part, no other
    for path in native.sources():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(native, "SOURCE", tmp_path / "kernels.c")
    before = native._cache_dir()
    with (tmp_path / includes[-1]).open("a") as part:
        part.write("\n")
    assert native._cache_dir() != before


def test_without_a_compiler_the_error_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with pytest.raises(native.KernelsUnavailable, match="--weights fp32"):
        native.build("generic", tmp_path)


@pytest.mark.parametrize("variant", [*VARIANTS, "neon-dotprod", "neon"])
def test_every_variant_this_cpu_runs_computes_the_same_products(variant):
    """Hosts differ between runs (AVX2-only EPYCs, AVX-512 Xeons, ARM64): each build is
    checked wherever the CPU can run it."""
    builds = native.variants()
    if variant not in builds or not builds[variant][1] <= cpu_flags():
        pytest.skip(f"this CPU cannot run the {variant} build")
    lib, _ = library(variant)
    assert lib.tq_activation_bits() == (32 if variant == "generic" else 16)
    for kind in FORMATS:
        w, ref = weight(kind, 40, 512)
        for num_rows in (1, 3):
            x = torch.randn(num_rows, 512)
            y = torch.empty(num_rows, 40)
            rc = lib.tq_gemv(w.type_id, w.data.data_ptr(), w.data.stride(0), 40, 512,
                             x.data_ptr(), num_rows, y.data_ptr(), 40)  # fmt: skip
            assert rc == 0 and relative(y, expected(kind, x, ref, lib)) < 1e-5, (variant, kind)
            assert relative(y, x @ ref.t()) < 1e-4, (variant, kind)  # x's rounding
        for num_rows in (5, 37):  # tq_gemm: int16 panels (AVX-512, AVX2) or fp32 tiles
            x = torch.randn(num_rows, 512)
            y = torch.empty(num_rows, 40)
            rc = lib.tq_gemm(w.type_id, w.data.data_ptr(), w.data.stride(0), 40, 512,
                             x.data_ptr(), num_rows, y.data_ptr(), 40)  # fmt: skip
            assert rc == 0 and relative(y, expected(kind, x, ref, lib)) < 1e-5, (variant, kind)


@pytest.mark.parametrize("kind", FORMATS)
def test_dequantize_equals_gguf_reference(kind):
    w, ref = weight(kind, 24, 512)
    ours = dequantize(w)
    # The kernels may fuse d * q + m into one rounding where numpy rounds twice.
    assert torch.allclose(ours, ref, rtol=1e-6, atol=1e-7)
    assert torch.allclose(dequantize(w, 5, 9), ref[5:9], rtol=1e-6, atol=1e-7)
    index = torch.tensor([3, 0, 23, 3])
    assert torch.allclose(rows(w, index), ref[index], rtol=1e-6, atol=1e-7)
    with pytest.raises(IndexError):
        rows(w, torch.tensor([24]))


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("num_rows", [1, 3, 4, 5, 16, 70, 130])
# 203 output rows: the last tile of four is short
def test_products_match_the_dequantized_weight(kind, num_rows):
    """Every path: tq_gemv (<= GEMV_ROWS), tq_gemm (<= GEMM_ROWS; short last tiles),
    dequantized slices above (x rounded as the integer path rounds it)."""
    w, ref = weight(kind, 203, 768, seed=num_rows)
    bias = torch.randn(203)
    x = torch.randn(num_rows, 768)
    assert relative(QuantLinear(w, bias)(x), expected(kind, x, ref) + bias) < 1e-5


def test_16_bit_activations_cost_under_1e4_of_the_fp32_product():
    """With outliers as a real model's activations have them (a block's largest |x| ~30x
    its mean): the rounding of x stays small next to the product, and within its bound,
    half a rounding step (max |x| / 32767 of the block) per value times |w|. (The worst
    of 30 random x per format came to 0.7-1.0e-4 of the product: x is seeded here.)"""
    for kind in X16_FORMATS:
        w, ref = weight(kind, 64, 1536)
        x = torch.randn(4, 1536, generator=torch.Generator().manual_seed(1))
        x[:, ::97] *= 30
        y = QuantLinear(w)(x)
        assert relative(y, expected(kind, x, ref)) < 1e-5
        assert relative(y, x @ ref.t()) < 1e-4
        half_step = x.reshape(4, -1, 32).abs().amax(-1, keepdim=True) / 32767 / 2
        bound = half_step.expand(-1, -1, 32).reshape(4, -1) @ ref.abs().t()
        assert bool(((y - x @ ref.t()).abs() <= bound + 1e-5 * y.abs().max()).all()), kind


@pytest.mark.parametrize("kind", FORMATS)
def test_a_row_computes_the_same_bits_alone_or_in_any_batch_of_its_class(kind):
    """Up to GEMV_ROWS rows (a decode step of a few streams) a row's result has the same
    bits alone or beside others, and so has it among 5 or more rows (int16 panels, or fp32
    tiles on x rounded the same way); the two classes agree to summation order, and to the
    bit where int16 panels multiply the format (the test below)."""
    w, _ = weight(kind, 70, 512)
    x = torch.randn(40, 512)
    few, many = QuantLinear(w)(x[: QuantLinear.GEMV_ROWS]), QuantLinear(w)(x)
    for size in range(1, QuantLinear.GEMV_ROWS + 1):
        assert torch.equal(QuantLinear(w)(x[:size]), few[:size]), size
    for size in (5, 9, 17):
        assert torch.equal(QuantLinear(w)(x[:size]), many[:size]), size
    assert torch.equal(QuantLinear(w)(x[30:]), many[30:])  # rows not first in a batch
    assert relative(few, many[: QuantLinear.GEMV_ROWS]) < 1e-6


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_a_k_quant_row_has_the_same_bits_in_a_decode_step_of_1_to_128_rows(kind):
    """The K-quants' integer sub-block dots take every row count up to GEMM_ROWS (tq_gemv
    and tq_gemm alike): a row's bits do not depend on the batch, across both classes."""
    if library()[0].tq_activation_bits() != 16:
        pytest.skip("the generic build multiplies K-quants in fp32")
    w, ref = weight(kind, 70, 512)
    x = torch.randn(QuantLinear.GEMM_ROWS, 512)
    x[:, ::61] *= 30
    batch = QuantLinear(w)(x)
    for start, size in ((0, 1), (5, 3), (9, 4), (20, 5), (40, 37), (127, 1)):
        assert torch.equal(QuantLinear(w)(x[start : start + size]), batch[start : start + size])
    assert relative(batch, expected(kind, x, ref)) < 3e-5  # x16() may round a tie apart


PANEL_VARIANTS = ("avx512vnni", "avx512", "avx2")  # int16 panels: 512-bit, and 256-bit


@pytest.mark.parametrize("variant", PANEL_VARIANTS)
@pytest.mark.parametrize("kind", PANEL_FORMATS)
def test_with_int16_panels_a_row_has_the_same_bits_from_1_row_to_a_2000_row_prefill(
    kind, variant, monkeypatch
):
    """The AVX-512 and AVX2 builds multiply any batch of 5+ rows in int16 panels (512- or
    256-bit), and 1-16 rows (tq_gemv: a decode step of a few streams, the fused decode
    layer) 8 weight rows a pass with the panels' exact block sums and their fp32 steps: a
    row of a 2,000-row prefill has the same bits as in a decode step of 1, 3 or 16 rows
    (chunked = unchunked, a stream's tokens independent of the streams beside it), and the
    products are gguf-py's weights times x rounded."""
    if not VARIANTS[variant][1] <= cpu_flags():
        pytest.skip(f"this CPU cannot run the {variant} build")
    monkeypatch.setenv("TANDEM_KERNELS", variant)  # QuantLinear takes the forced build
    assert library()[0].tq_panel_products() == (
        3 if variant == "avx2" else 1 + (variant == "avx512vnni")
    )
    w, ref = weight(kind, 70, 512)  # 70 columns: the last panel of 32 (or 16) is short
    x = torch.randn(2000, 512)
    x[:, ::61] *= 30
    wide = QuantLinear(w)(x)
    for start, size in ((0, 5), (7, 9), (1990, 10), (600, 130), (0, 1), (1999, 1), (40, 3),
                        (61, 4)):  # fmt: skip
        assert torch.equal(QuantLinear(w)(x[start : start + size]), wide[start : start + size])
    lib = library()[0]
    for start, size in ((100, 7), (1984, 16)):  # tq_gemv past GEMV_ROWS (the decode layer)
        y = torch.empty(size, 70)
        part = x[start : start + size].contiguous()
        rc = lib.tq_gemv(w.type_id, w.data.data_ptr(), w.data.stride(0), 70, 512,
                         part.data_ptr(), size, y.data_ptr(), 70)  # fmt: skip
        assert rc == 0 and torch.equal(y, wide[start : start + size]), (start, size)
    assert relative(wide, expected(kind, x, ref)) < 3e-5  # the worst of 140,000 values


@pytest.mark.parametrize("variant", PANEL_VARIANTS)
@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_a_k_quant_prefill_chunk_goes_through_int16_panels_of_its_pieces(
    kind, variant, monkeypatch
):
    """Above GEMM_ROWS (a prefill chunk) the K-quants are multiplied in the int16 panels,
    each 256-value block as 8 pieces of 32 with their own scales (quant/kquant_pieces.h):
    gguf-py's weights times x rounded, and a row's bits the same in any chunk of 129+ rows
    (chunked = unchunked)."""
    if not VARIANTS[variant][1] <= cpu_flags():
        pytest.skip(f"this CPU cannot run the {variant} build")
    monkeypatch.setenv("TANDEM_KERNELS", variant)
    w, ref = weight(kind, 70, 768)  # 3 blocks a row; the last panel is short
    linear = QuantLinear(w)
    assert linear.native_paths == ("gemv", "gemm", "panel")
    x = torch.randn(1000, 768)
    x[:, ::61] *= 30
    wide = linear(x)
    for start, size in ((0, 129), (500, 200), (871, 129)):
        assert torch.equal(linear(x[start : start + size]), wide[start : start + size])
    assert relative(wide, expected(kind, x, ref)) < 3e-5
    # the product below the panels' rows: the integer sub-block dots, same values
    assert relative(linear(x[:128]), wide[:128]) < 1e-6
    # the kernel choice may take the panels at 5-128 rows: a row's bits the same there too
    assert linear.candidates(1)[:2] == ["gemm", "panel"]
    assert torch.equal(linear.product("panel", x[3:8]), wide[3:8])


def test_prefill_sized_products_go_through_dequantized_slices(monkeypatch):
    monkeypatch.setattr(QuantLinear, "SLICE_VALUES", 256 * 10)  # 10 rows a slice
    w, ref = weight("Q4_K", 45, 256)
    x = torch.randn(QuantLinear.GEMM_ROWS + 1, 256)
    assert relative(QuantLinear(w).product("sliced", x), expected("Q4_K", x, ref)) < 1e-5
    one = weight("Q4_0", 8, 256)
    x = torch.randn(QuantLinear.GEMM_ROWS + 1, 256)
    assert relative(QuantLinear(one[0])(x), expected("Q4_0", x, one[1])) < 1e-5  # one slice


def test_the_wide_path_rounds_x_as_the_integer_path_does():
    """A prefill of more than GEMM_ROWS rows and the same rows a chunk at a time agree to
    fp32 summation order (~1e-6), not merely to x's rounding (~2e-5 here)."""
    w, ref = weight("Q4_1", 96, 512)
    x = torch.randn(QuantLinear.GEMM_ROWS + 8, 512, generator=torch.Generator().manual_seed(5))
    x[:, ::61] *= 30
    wide = QuantLinear(w)(x)
    chunks = torch.cat([QuantLinear(w)(x[i : i + 32]) for i in range(0, x.shape[0], 32)])
    assert relative(wide, chunks) < 3e-6
    assert relative(x @ ref.t(), chunks) > 1e-5  # unrounded x would be told apart


def test_fusing_stacks_one_format_and_splits_mixed_ones():
    (a, ra), (b, rb) = weight("Q4_1", 32, 256, 1), weight("Q4_1", 16, 256, 2)
    (c, rc) = weight("Q6_K", 16, 256, 3)
    assert isinstance(fused_linear([a, b]), QuantLinear)
    assert stack_rows([a, b]).shape == (48, 256)
    mixed = fused_linear([a, c], torch.arange(48.0))
    assert isinstance(mixed, SplitLinear) and mixed.out_features == 48
    x = torch.randn(2, 256)
    want = torch.cat([expected("Q4_1", x, ra), expected("Q6_K", x, rc)], -1) + torch.arange(48.0)
    assert relative(mixed(x), want) < 1e-5
    assert isinstance(fused_linear([ra, rb]), type(fused_linear([ra])))
    with pytest.raises(ValueError):
        stack_rows([a, c])
    with pytest.raises(ValueError, match="bytes a row"):
        QuantWeight("Q4_1", torch.zeros(4, 7, dtype=torch.uint8), 256)


# A tiny llama GGUF whose matrices use every supported format (q, k, v in three different
# ones, so the fused q|k|v product splits).
LAYERS = 2
KINDS = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q4_0",
         "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q8_0"}  # fmt: skip


def write_mixed_gguf(path) -> None:
    write_tiny_llama_gguf(
        path, [KINDS] * LAYERS, embed_output=("Q6_K", "Q8_0"), blocks=random_blocks, seeds=(7, 0)
    )


def last_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    core = make_core(model, None)
    core.add("0", ids, SamplingParams(max_tokens=1, temperature=0))
    sched = core.scheduler.schedule()
    return core.model.logits(core.runner.forward(sched.scheduled))[-1]


def test_a_gguf_of_every_format_computes_the_same_logits_native_and_dequantized(tmp_path):
    torch.set_num_threads(1)
    write_mixed_gguf(tmp_path / "mixed.gguf")
    native = load_gguf(str(tmp_path / "mixed.gguf"), weights="native")
    fp32 = load_gguf(str(tmp_path / "mixed.gguf"), weights="fp32")
    kinds = {name: w.kind for name, w in native.weights.items() if isinstance(w, QuantWeight)}
    assert kinds["layers.0.q"] == "Q4_K" and kinds["embed"] == "Q6_K"
    assert len(kinds) == 2 + LAYERS * len(KINDS)
    for name in kinds:  # Q/K rows un-permuted in place, blocks untouched
        assert torch.allclose(dequantize(native.weights[name]), fp32.weights[name], rtol=1e-6)
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    ours, ref = last_logits(LlamaModel(native), ids), last_logits(LlamaModel(fp32), ids)
    # 16-bit activations in the Q4_0 / Q4_1 / Q8_0 products (x's rounding), else 1e-5
    assert relative(ours, ref) < (1e-4 if library()[0].tq_activation_bits() == 16 else 1e-5)
    bf16 = load_gguf(str(tmp_path / "mixed.gguf"), weights="bf16")
    assert bf16.weights["layers.0.q"].dtype == torch.bfloat16
    assert bf16.weights["layers.0.attn_norm"].dtype == torch.float32
    assert relative(last_logits(LlamaModel(bf16), ids), ref) < 5e-2
    with pytest.raises(ValueError, match="weights must be one of"):
        load_gguf(str(tmp_path / "mixed.gguf"), weights="int3")
