"""A Triton paged decode-attention kernel (one query token per sequence).

Grid: (sequences, query heads). Each program walks its sequence's pages in
order, keeping an online softmax (running max m, normalizer l, accumulator
acc) so the context never has to be gathered. Pages are laid out as in
KVCache: [num_pages, page_size, kv_heads, head_dim].

On the CPU the kernel runs under Triton's interpreter: TRITON_INTERPRET=1 must
be in the environment before this module is first imported (tests do that).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, pages_ptr, ctx_ptr, scale,
    stride_q_tok, stride_q_head,
    stride_k_page, stride_k_slot, stride_k_head,
    stride_o_tok, stride_o_head, stride_pages,
    GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    ctx = tl.load(ctx_ptr + seq)
    dims = tl.arange(0, HEAD_DIM)
    slots = tl.arange(0, PAGE)
    q = tl.load(q_ptr + seq * stride_q_tok + head * stride_q_head + dims).to(tl.float32)
    m = tl.zeros([1], dtype=tl.float32) - float("inf")
    l_sum = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for p in range(0, tl.cdiv(ctx, PAGE)):
        page = tl.load(pages_ptr + seq * stride_pages + p)
        valid = p * PAGE + slots < ctx
        base = page * stride_k_page + kv_head * stride_k_head
        offs = base + slots[:, None] * stride_k_slot + dims[None, :]
        k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1) * scale
        scores = tl.where(valid, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        alpha = tl.exp(m - m_new)
        probs = tl.exp(scores - m_new)
        l_sum = l_sum * alpha + tl.sum(probs, axis=0)
        acc = acc * alpha + tl.sum(probs[:, None] * v, axis=0)
        m = m_new
    out = acc / l_sum
    tl.store(out_ptr + seq * stride_o_tok + head * stride_o_head + dims, out)


def paged_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, Hq, D]; k/v_pages [P, page_size, Hk, D]; page_table [B, max_pages] int32;
    ctx_lens [B] int32 (>= 1). Returns [B, Hq, D] (q's dtype)."""
    b, hq, d = q.shape
    page_size, hk = k_pages.shape[1], k_pages.shape[2]
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hk})")
    out = torch.empty(b, hq, d, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(b, hq)](
        q, k_pages, v_pages, out, page_table, ctx_lens, scale,
        q.stride(0), q.stride(1),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        out.stride(0), out.stride(1), page_table.stride(0),
        GROUP=hq // hk, PAGE=page_size, HEAD_DIM=d,
    )  # fmt: skip
    return out.to(q.dtype)
