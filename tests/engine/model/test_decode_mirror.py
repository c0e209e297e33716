"""The torch backend's decode mirror: the same attention as the paged path, step after step."""

from __future__ import annotations

import math

import torch

from libs.common.engine.model.attention import AttentionBatch, backend_class
from libs.common.engine.model.attention.decode_mirror import CAPACITY_STEP
from libs.common.engine.model.kv_cache import KVCache

HQ, HK, D, PS, LAYERS = 4, 2, 8, 4, 2


def _dense(q, k, v):
    """One decode row: q [HQ, D] (the last position) over k, v [ctx, HK, D]."""
    kk = k.repeat_interleave(HQ // HK, dim=1)
    vv = v.repeat_interleave(HQ // HK, dim=1)
    scores = torch.einsum("hd,khd->hk", q, kk) / math.sqrt(D)
    return torch.einsum("hk,khd->hd", scores.softmax(-1), vv).reshape(HQ * D)


class _Sim:
    """Sequences with known K/V histories, decoded through one backend."""

    def __init__(self, pages: int = 256, mirror: bool = True) -> None:
        self.kv = KVCache(LAYERS, pages, PS, HK, D)
        self.attn = backend_class("torch")(self.kv, HQ, decode_mirror=mirror)
        self.free = list(range(pages - 1, -1, -1))
        self.seqs: dict[int, dict] = {}

    def add(self, key: int, ctx: int) -> None:
        """A sequence whose first `ctx` tokens are already in its pages (a finished prefill)."""
        seq = {"k": [torch.randn(ctx, HK, D) for _ in range(LAYERS)], "pages": []}
        seq["v"] = [torch.randn(ctx, HK, D) for _ in range(LAYERS)]
        self.seqs[key] = seq
        self._grow(seq, ctx)
        for layer in range(LAYERS):
            for pos in range(ctx):
                self._put(seq, layer, pos)

    def rewrite(self, key: int) -> None:
        """New K/V for every cached position (what a recompute with other values would do)."""
        seq = self.seqs[key]
        for layer in range(LAYERS):
            seq["k"][layer].normal_()
            seq["v"][layer].normal_()
            for pos in range(seq["k"][layer].shape[0]):
                self._put(seq, layer, pos)

    def _grow(self, seq, ctx) -> None:
        while len(seq["pages"]) * PS < ctx:
            seq["pages"].append(self.free.pop())

    def _put(self, seq, layer, pos) -> None:
        page, slot = seq["pages"][pos // PS], pos % PS
        self.kv.key(layer)[page, slot] = seq["k"][layer][pos]
        self.kv.value(layer)[page, slot] = seq["v"][layer][pos]

    def step(self, keys: list[int], finish: bool = True) -> None:
        """One decode token for each of `keys`; checks every layer against dense attention."""
        new = {}
        for key in keys:
            seq = self.seqs[key]
            ctx = seq["k"][0].shape[0] + 1
            self._grow(seq, ctx)
            new[key] = [(torch.randn(1, HK, D), torch.randn(1, HK, D)) for _ in range(LAYERS)]
            for layer in range(LAYERS):
                seq["k"][layer] = torch.cat([seq["k"][layer], new[key][layer][0]])
                seq["v"][layer] = torch.cat([seq["v"][layer], new[key][layer][1]])
        batch = AttentionBatch(
            [1] * len(keys),
            [self.seqs[k]["k"][0].shape[0] for k in keys],
            [self.seqs[k]["pages"] for k in keys],
            keys,
        )
        plan = self.attn.plan(batch)
        for layer in range(LAYERS if finish else 1):
            q = torch.randn(len(keys), HQ, D)
            k_new = torch.cat([new[key][layer][0] for key in keys])
            v_new = torch.cat([new[key][layer][1] for key in keys])
            out = self.attn.forward(layer, q, k_new, v_new, plan)
            for row, key in enumerate(keys):
                seq = self.seqs[key]
                expect = _dense(q[row], seq["k"][layer], seq["v"][layer])
                torch.testing.assert_close(out[row], expect, rtol=1e-5, atol=1e-5)


def test_mirror_matches_dense_attention_while_rows_join_leave_and_grow():
    torch.manual_seed(0)
    sim = _Sim(pages=1024)
    for key, ctx in ((1, 5), (2, 9), (3, 1)):
        sim.add(key, ctx)
    for _ in range(3):
        sim.step([1, 2, 3])
    assert sim.attn.mirror.num_slots == 3
    sim.add(4, 30)
    sim.step([1, 2, 3, 4])  # a row joins: four slots
    sim.step([2, 4, 1])  # a row leaves and the order changes: slots stay, q is scattered
    sim.add(5, 7)
    sim.step([5, 2, 4, 1])  # the new row takes the free slot
    assert sim.attn.mirror.num_slots == 4
    sim.add(6, CAPACITY_STEP + 3)  # longer than the capacity: the mirror grows, all refill
    sim.step([6, 5])
    assert sim.attn.mirror.capacity >= CAPACITY_STEP + 4
    for _ in range(2):
        sim.step([1, 2, 4, 5, 6])
    assert sim.attn.mirror.num_slots == 5
    assert sim.attn.mirror.slot_of(4) == 2
    sim.step([4])  # one row left in a wide mirror: it moves to slot 0
    assert sim.attn.mirror.slot_of(4) == 0
    assert sim.attn.mirror.slot_of(1) is None  # rows that left hold no slot
    sim.step([4])


def test_a_row_that_skipped_a_step_or_a_broken_step_refills_from_pages():
    torch.manual_seed(1)
    sim = _Sim()
    sim.add(1, 6)
    sim.add(2, 11)
    sim.step([1, 2])
    # A prefill-only step in between (no decode rows): recompute may rewrite the pages.
    sim.attn.plan(AttentionBatch([3], [3], [[sim.free[-1]]], [99]))
    sim.rewrite(1)
    sim.step([1, 2])
    # A step whose forward stopped after its first layer: its plan is not trusted. Here
    # the last layer's new K/V reach the pages another way, never the mirror.
    sim.step([1, 2], finish=False)
    for key in (1, 2):
        seq = sim.seqs[key]
        sim._put(seq, LAYERS - 1, seq["k"][0].shape[0] - 1)
    sim.step([1, 2])


def test_mirror_off_when_it_would_outgrow_the_paged_cache():
    torch.manual_seed(2)
    sim = _Sim(pages=40)  # 160 tokens of cache: a mirror of 2 x 128-token slots is larger
    sim.add(1, 20)
    sim.add(2, 20)
    sim.step([1, 2])
    assert sim.attn.mirror.num_slots == 0
    sim.step([1, 2])


def test_without_keys_or_with_the_mirror_off_the_paged_path_runs():
    torch.manual_seed(3)
    sim = _Sim(mirror=False)
    sim.add(1, 9)
    sim.step([1])
    assert sim.attn.mirror is None
    on = _Sim()
    on.add(1, 9)
    batch = AttentionBatch([1], [10], [on.seqs[1]["pages"] + [on.free.pop()]])
    on.attn.plan(batch)  # no seq_keys: nothing is kept
    assert on.attn.mirror.num_slots == 0
