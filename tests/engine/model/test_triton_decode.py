"""The Triton paged decode kernel, run on the CPU by Triton's interpreter.

TRITON_INTERPRET=1 must be set before triton itself is imported (its own
@jit helpers are bound then), so the kernel runs in a fresh interpreter
process with the variable set.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (pip install -r requirements/test.txt)",
)

CASES = [(4, 2, [1, 5, 9]), (3, 3, [16, 2]), (6, 1, [7])]


def check_kernel_against_dense_attention() -> None:
    """Runs in the child process; raises on any mismatch."""
    from libs.common.engine.model.attention.triton_decode import paged_decode_attention

    torch.manual_seed(0)
    d, ps, pages = 16, 4, 12
    for hq, hk, ctx in CASES:
        k_pages, v_pages = torch.randn(pages, ps, hk, d), torch.randn(pages, ps, hk, d)
        width = -(-max(ctx) // ps)
        table = torch.stack([torch.randperm(pages)[:width] for _ in ctx]).to(torch.int32)
        q = torch.randn(len(ctx), hq, d)
        lens = torch.tensor(ctx, dtype=torch.int32)
        out = paged_decode_attention(q, k_pages, v_pages, table, lens, d**-0.5)
        for b, n in enumerate(ctx):
            keys = k_pages[table[b].long()].reshape(-1, hk, d)[:n].repeat_interleave(hq // hk, 1)
            vals = v_pages[table[b].long()].reshape(-1, hk, d)[:n].repeat_interleave(hq // hk, 1)
            probs = (torch.einsum("hd,khd->hk", q[b], keys) * d**-0.5).softmax(-1)
            expect = torch.einsum("hk,khd->hd", probs, vals)
            torch.testing.assert_close(out[b], expect, rtol=1e-5, atol=1e-5)
    print("ok")


def _in_interpreter(check: str) -> None:
    code = f"import tests.engine.model.test_triton_decode as t; t.{check}()"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=240)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_paged_decode_kernel_matches_dense_attention_under_the_interpreter():
    _in_interpreter("check_kernel_against_dense_attention")


def check_backend_against_torch() -> None:
    """Runs in the child process: the triton backend's outputs equal the torch backend's
    (paged, no mirror) over decode-only steps and steps mixing decode rows and a prefill."""
    from libs.common.engine.model.attention import AttentionBatch, backend_class
    from libs.common.engine.model.kv_cache import KVCache

    tables = {1: [0, 1, 2], 2: [3, 4, 5], 3: [6, 7, 8]}
    steps = [([1, 2], [5, 6], [5, 6]), ([1, 2], [1, 1], [6, 7]), ([1, 2], [1, 1], [7, 8]),
             ([1, 2, 3], [1, 1, 3], [8, 9, 3]), ([1, 2, 3], [1, 1, 2], [9, 10, 5])]  # fmt: skip

    def outputs(name: str, **options: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        attn = backend_class(name)(KVCache(2, 64, 4, 2, 8), 4, **options)
        out = []
        for keys, q_lens, ctx in steps:
            plan = attn.plan(AttentionBatch(q_lens, ctx, [tables[k] for k in keys], keys))
            for layer in range(2):
                t = sum(q_lens)
                q, k, v = torch.randn(t, 4, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)
                out.append(attn.forward(layer, q, k, v, plan))
        return out

    for got, expect in zip(outputs("triton"), outputs("torch", decode_mirror=False), strict=True):
        torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-4)
    print("ok")


def test_triton_backend_matches_torch_on_decode_and_mixed_steps():
    _in_interpreter("check_backend_against_torch")


def test_cuda_backends_stay_unimported_when_torch_is_chosen():
    code = (
        "import sys; from libs.common.engine.model.attention import backend_class; "
        "backend_class('torch'); "
        "assert 'flashinfer' not in sys.modules and 'triton' not in sys.modules; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
