"""The paged KV cache and the torch attention backend against dense attention."""

from __future__ import annotations

import math

import pytest
import torch

from libs.common.engine.model.attention import AttentionBatch, backend_class
from libs.common.engine.model.kv_cache import KVCache

HQ, HK, D, PS = 4, 2, 8, 4


def _cache(pages: int = 32) -> KVCache:
    return KVCache(num_layers=2, num_pages=pages, page_size=PS, num_kv_heads=HK, head_dim=D)


def test_export_then_import_moves_exact_bytes():
    src, dst = _cache(), _cache()
    src.buffer.normal_()
    data = src.export_pages([3, 7])
    dst.import_pages([10, 1], data)
    assert torch.equal(dst.buffer[:, :, 10], src.buffer[:, :, 3])
    assert torch.equal(dst.buffer[:, :, 1], src.buffer[:, :, 7])


def test_page_ranges_cover_the_exported_bytes_in_order():
    kv = _cache()
    kv.buffer.normal_()
    raw = kv.buffer.view(-1).view(torch.uint8).numpy().tobytes()
    joined = b"".join(raw[o : o + n] for o, n in kv.page_ranges([5, 2]))
    assert joined == kv.export_pages([5, 2]).numpy().tobytes()
    assert sum(n for _, n in kv.page_ranges([5])) == kv.page_nbytes


def test_import_rejects_a_wrong_shape():
    with pytest.raises(ValueError, match="imported KV"):
        _cache().import_pages([0], torch.zeros(1, 2, 2, PS, HK, D + 1))


def _dense(q, k, v, q_start):
    """Reference: causal GQA attention of q (positions q_start..) over k, v [ctx, HK, D]."""
    kk = k.repeat_interleave(HQ // HK, dim=1)
    vv = v.repeat_interleave(HQ // HK, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(D)
    qpos = torch.arange(q_start, q_start + q.shape[0]).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv).reshape(q.shape[0], HQ * D)


def _check_against_dense(seqs, torch_seed: int) -> None:
    """seqs: (cached tokens already in the pages, new tokens this step, page table)."""
    torch.manual_seed(torch_seed)
    kv = _cache()
    attn = backend_class("torch")(kv, HQ)
    full_k = [torch.randn(c + n, HK, D) for c, n, _ in seqs]
    full_v = [torch.randn(c + n, HK, D) for c, n, _ in seqs]
    for (c, _, pages), k, v in zip(seqs, full_k, full_v, strict=True):
        for pos in range(c):
            kv.key(0)[pages[pos // PS], pos % PS] = k[pos]
            kv.value(0)[pages[pos // PS], pos % PS] = v[pos]
    q = torch.cat([torch.randn(n, HQ, D) for _, n, _ in seqs])
    new_k = torch.cat([k[c:] for (c, _, _), k in zip(seqs, full_k, strict=True)])
    new_v = torch.cat([v[c:] for (c, _, _), v in zip(seqs, full_v, strict=True)])
    batch = AttentionBatch([n for _, n, _ in seqs], [c + n for c, n, _ in seqs],
                           [p for _, _, p in seqs])  # fmt: skip
    out = attn.forward(0, q, new_k, new_v, attn.plan(batch))
    row = 0
    for (c, n, _), k, v in zip(seqs, full_k, full_v, strict=True):
        expect = _dense(q[row : row + n], k, v, c)
        torch.testing.assert_close(out[row : row + n], expect, rtol=1e-5, atol=1e-5)
        row += n


def test_torch_backend_matches_dense_attention_on_a_mixed_batch():
    """Decode rows, a chunk after a cached prefix and a fresh prompt in one step."""
    seqs = [(9, 1, [5, 2, 30]), (13, 1, [4, 6, 8, 11]), (6, 7, [1, 3, 9, 12]), (0, 10, [7, 14, 15])]
    _check_against_dense(seqs, 0)


def test_adjacent_whole_prompts_of_one_length_attend_as_one_batch_and_stay_apart():
    """Fresh prompts of 6, 6, 6, then 3, a decode row, then 6 again: grouped only when adjacent."""
    seqs = [(0, 6, [0, 1]), (0, 6, [2, 3]), (0, 6, [4, 5]), (0, 3, [6]), (5, 1, [7, 8]),
            (0, 6, [9, 10])]  # fmt: skip
    _check_against_dense(seqs, 4)


def test_unknown_backend_is_refused_by_name():
    with pytest.raises(ValueError, match="attention_backend"):
        backend_class("nope")
