"""The CPU kernels beside the quantized products: decode attention over the mirror, the
fused residual-add RMSNorm, RoPE, SwiGLU and the sampler's argmax, against torch's own
ops, in every build of the kernels the CPU runs (TANDEM_KERNELS forces each in turn)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from libs.common.engine.model.attention.torch_backend import _KV_TYPES
from libs.common.engine.model.fused import add_rms_norm, argmax, rms_norm, rope, swiglu
from libs.common.engine.model.quant.native import VARIANTS, cpu_flags, library


@pytest.fixture(autouse=True, params=list(VARIANTS))
def kernel_build(request, monkeypatch):
    """Each test once per build (avx512vnni, avx512, avx2, generic) this CPU can run."""
    if not VARIANTS[request.param][1] <= cpu_flags():
        pytest.skip(f"this CPU cannot run the {request.param} build")
    monkeypatch.setenv("TANDEM_KERNELS", request.param)
    return request.param


def reference_attention(q, keys, values, slots, lens, hk):
    """sdpa row by row: q [B, Hq, D]; keys/values [S, Hk, cap, D]."""
    out = []
    for b in range(q.shape[0]):
        k = keys[slots[b], :, : lens[b]].float()
        v = values[slots[b], :, : lens[b]].float()
        group = q.shape[1] // hk
        qs = q[b].view(hk, group, -1)
        out.append(F.scaled_dot_product_attention(qs, k, v).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("hq", "hk", "d"), [(9, 3, 64), (4, 4, 32), (8, 1, 128)])
def test_decode_attention_matches_sdpa(dtype, hq, hk, d):
    lib, _ = library()
    gen = torch.Generator().manual_seed(hq * d)
    slots_total, cap = 5, 700
    keys = torch.randn(slots_total, hk, cap, d, generator=gen).to(dtype)
    values = torch.randn(slots_total, hk, cap, d, generator=gen).to(dtype)
    # Contexts across the kernel's 256-token chunks: 1, one chunk exactly, and beyond.
    slots = torch.tensor([3, 0, 4, 1], dtype=torch.long)
    lens = torch.tensor([1, 256, 700, 300], dtype=torch.int32)
    q = torch.randn(4, hq, d, generator=gen) * 2
    out = torch.empty(4, hq * d)
    rc = lib.tq_decode_attention(
        q.data_ptr(), keys.data_ptr(), values.data_ptr(), _KV_TYPES[dtype],
        keys.stride(0), keys.stride(1), slots.data_ptr(), lens.data_ptr(),
        4, hq, hk, d, d**-0.5, out.data_ptr(),
    )  # fmt: skip
    assert rc == 0
    ref = reference_attention(q, keys, values, slots.tolist(), lens.tolist(), hk)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_decode_attention_refuses_shapes_it_cannot_do():
    lib, _ = library()
    out = torch.empty(1, 8)
    z = torch.zeros(1, dtype=torch.long)
    one = torch.ones(1, dtype=torch.int32)
    x = torch.zeros(8)
    rc = lib.tq_decode_attention(x.data_ptr(), x.data_ptr(), x.data_ptr(), 0, 8, 8,
                                 z.data_ptr(), one.data_ptr(), 1, 3, 2, 8, 1.0,
                                 out.data_ptr())  # fmt: skip
    assert rc == -1  # 3 query heads cannot share 2 KV heads


def test_rms_norm_and_the_fused_residual_add_match_torch():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(13, 576, generator=gen)
    delta = torch.randn(13, 576, generator=gen)
    w = torch.rand(576, generator=gen) + 0.5
    expected = F.rms_norm(x, (576,), w, 1e-5)
    assert torch.allclose(rms_norm(x, w, 1e-5), expected, rtol=1e-5, atol=1e-6)
    total = x + delta
    summed, normed = add_rms_norm(x.clone(), delta, w, 1e-5)
    assert torch.equal(summed, total)
    assert torch.allclose(normed, F.rms_norm(total, (576,), w, 1e-5), rtol=1e-5, atol=1e-6)
    # Not contiguous: torch's own op, same result.
    strided = torch.randn(576, 13, generator=gen).t()
    assert torch.allclose(rms_norm(strided, w, 1e-5), F.rms_norm(strided, (576,), w, 1e-5))


def test_rope_matches_the_torch_formula_on_strided_rows():
    gen = torch.Generator().manual_seed(1)
    t, h, d = 7, 12, 64
    qkv = torch.randn(t, h * d + 100, generator=gen)  # rows wider than the heads rotated
    x = qkv[:, : h * d].view(t, h, d)
    angles = torch.rand(t, 1, d // 2, generator=gen) * 50
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    half = d // 2
    expected = x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
    assert torch.allclose(rope(x, cos, sin), expected, rtol=1e-6, atol=1e-6)


def test_argmax_is_torch_argmax_ties_infinities_and_nans_included():
    gen = torch.Generator().manual_seed(3)
    for rows, cols in ((1, 49152), (32, 49152), (5, 17), (3, 1)):
        x = torch.randn(rows, cols, generator=gen)
        assert torch.equal(argmax(x), torch.argmax(x, dim=-1)), (rows, cols)
    x = torch.zeros(5, 100)
    x[0, [40, 7, 99]] = 2.0  # a tie: the first
    x[1] = float("-inf")  # every token masked
    x[2, [61, 80]] = float("nan")  # the first NaN, past a larger number
    x[2, 3] = 5.0
    x[3, 99] = float("inf")  # in the scalar tail
    x[4, 96:] = torch.tensor([1.0, 3.0, 3.0, 2.0])
    assert argmax(x).tolist() == torch.argmax(x, dim=-1).tolist() == [7, 0, 61, 99, 97]
    strided = torch.randn(4, 64, generator=gen)[:, ::2]  # not contiguous: torch's
    assert torch.equal(argmax(strided), torch.argmax(strided, dim=-1))


def test_swiglu_matches_silu_times_up():
    gen = torch.Generator().manual_seed(2)
    gate_up = torch.randn(9, 2 * 1536, generator=gen) * 6  # saturating gates too
    gate, up = gate_up.split(1536, dim=-1)
    assert torch.allclose(swiglu(gate_up, 1536), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_scatter_rounds_like_tensor_to(dtype):
    """The decode step's K/V writes must equal what the torch path stores, bit for bit."""
    lib, _ = library()
    gen = torch.Generator().manual_seed(5)
    n, heads, d = 3, 2, 64
    wide = torch.randn(n, heads * d + 32, generator=gen) * 100  # strided rows, like k in qkv
    wide[0, :4] = torch.tensor([float("inf"), float("-inf"), 3.3895e38, 1e-41])
    src = wide[:, : heads * d].view(n, heads, d)
    dst = torch.zeros(10 * heads, d, dtype=dtype)
    slots = torch.tensor([7, 2, 5])
    index = (slots.unsqueeze(1) * heads + torch.arange(heads)).reshape(-1)
    rc = lib.tq_scatter_heads(src.data_ptr(), src.stride(0), n, heads, d, None,
                              index.data_ptr(), dst.data_ptr(), _KV_TYPES[dtype])  # fmt: skip
    assert rc == 0
    expected = torch.zeros_like(dst)
    expected.view(-1, heads, d).index_copy_(0, slots, src.to(dtype))
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(dst.view(bits), expected.view(bits))
