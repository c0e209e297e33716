"""Attention in plain torch: the CPU backend and the reference for the others.

Decode rows (one new token per sequence) are attended in one batched
scaled_dot_product_attention call over their pages gathered and padded to the
longest context. The call sees each KV head's group of query heads as a
"query length" of group size (q [B, kv_heads, group, d] against K/V
[B, kv_heads, T, d]) with one additive float mask built per step: SDPA's
enable_gqa path and a bool mask measured slower per layer at batch 32 on the
CPU (docs/engine.md, "KV layout"). When the step names its sequences
(`AttentionBatch.seq_keys`) the decode rows read a dense mirror of their K/V
instead of gathering pages (attention/decode_mirror.py; off with
`decode_mirror=False`). Prefill chunks run one sequence at a time, except
adjacent chunks that are whole prompts of one length: those attend to their own
fresh K/V in one batched call, without touching the cache.
"""

from __future__ import annotations

import ctypes
import dataclasses

import torch
import torch.nn.functional as F

from libs.common.engine.model.attention.base import AttentionBackend, AttentionBatch, slot_mapping
from libs.common.engine.model.attention.decode_mirror import COMPUTE_DTYPE, DecodeMirror, MirrorPlan
from libs.common.engine.model.kv_cache import KVCache
from libs.common.engine.model.quant.native import optional_library


@dataclasses.dataclass(slots=True)
class _Decode:
    rows: torch.Tensor | None  # None when every row of the step is a decode row
    pages: torch.Tensor | None  # [B * max_pages] page ids, padded with page 0; None: mirror
    mask: torch.Tensor  # [B, 1, 1, max_pages * page_size], 0 where attended, -inf past the end
    batch: int
    mirror: MirrorPlan | None = None  # set: attention reads the mirror
    # The kernel's KV writes, built at the step's first layer (flat row indices):
    # paged rows (slot * Hk + h), the continuing rows' token rows and mirror rows.
    kernel_writes: tuple[torch.Tensor, torch.Tensor | None] | None = None


@dataclasses.dataclass(slots=True)
class _Prefill:
    start: int
    end: int
    ctx: int
    pages: torch.Tensor | None  # None: the chunk is the whole context so far
    mask: torch.Tensor | None  # [q, ctx] bool; None with pages=None (plain causal)
    count: int = 1  # pages=None only: this many adjacent whole prompts of ctx tokens each


@dataclasses.dataclass(slots=True)
class TorchPlan:
    slots: torch.Tensor
    num_tokens: int
    decode: _Decode | None
    prefills: list[_Prefill]


_KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# The most rows of one sequence a step attends as decode rows (a verification of up to
# MAX_VERIFY_ROWS - 1 drafts); longer items take the prefill path.
MAX_VERIFY_ROWS = 8


@dataclasses.dataclass(slots=True)
class FusedDecodeArgs:
    """Addresses and strides a fused decode layer needs (tq_step_t's K/V part, in order)."""

    k_pages: int
    v_pages: int
    layer_stride: int  # bytes between two layers' pages
    kv_type: int
    paged_index: int
    mirror_k: int
    mirror_v: int
    mirror_layer_stride: int  # bytes
    n_mirror: int
    mirror_src: int
    mirror_dst: int
    slot_stride: int  # elements
    head_stride: int
    slots: int
    lens: int
    scale: float

    def pointers(self) -> tuple:
        return dataclasses.astuple(self)


class TorchAttention(AttentionBackend):
    """See AttentionBackend; works on any device torch supports."""

    name = "torch"

    def __init__(self, kv_cache: KVCache, num_heads: int, decode_mirror: bool = True) -> None:
        super().__init__(kv_cache, num_heads)
        self.mirror = DecodeMirror(kv_cache) if decode_mirror else None
        # On the CPU, decode attention over the mirror is a C kernel (quant/attention.h):
        # it reads K/V in their stored dtype and only each row's own context.
        self._kernel: ctypes.CDLL | None = None
        if self.mirror is not None and kv_cache.buffer.device.type == "cpu":
            self._kernel = optional_library()

    def plan(self, batch: AttentionBatch) -> TorchPlan:
        dev = self.kv_cache.buffer.device
        ps = self.kv_cache.page_size
        slots = torch.tensor(slot_mapping(batch, ps), dtype=torch.long, device=dev)
        decode_idx = [i for i, q in enumerate(batch.q_lens) if q == 1 or self._verifies(batch, i)]
        starts = [0]
        for q in batch.q_lens:
            starts.append(starts[-1] + q)
        decode = None
        if decode_idx:
            decode = self._plan_decode(batch, decode_idx, starts, dev)
        elif self.mirror is not None:
            self.mirror.forget()
        prefills: list[_Prefill] = []
        decoding = set(decode_idx)
        for i, q in enumerate(batch.q_lens):
            if i in decoding:
                continue
            ctx = batch.ctx_lens[i]
            if ctx == q:
                last = prefills[-1] if prefills else None
                if last and last.pages is None and last.ctx == ctx and last.end == starts[i]:
                    last.end, last.count = starts[i + 1], last.count + 1  # one SDPA call
                else:
                    prefills.append(_Prefill(starts[i], starts[i + 1], ctx, None, None))
                continue
            n_pages = -(-ctx // ps)
            pages = torch.tensor(batch.page_tables[i][:n_pages], dtype=torch.long, device=dev)
            # Row r (position ctx - q + r) sees columns 0 .. ctx - q + r.
            cols = torch.arange(ctx, device=dev)
            rows = torch.arange(ctx - q, ctx, device=dev)
            mask = cols.unsqueeze(0) <= rows.unsqueeze(1)
            prefills.append(_Prefill(starts[i], starts[i + 1], ctx, pages, mask))
        return TorchPlan(slots, batch.num_tokens, decode, prefills)

    def _verifies(self, batch: AttentionBatch, i: int) -> bool:
        """Whether item i is a verification (its first row and its drafts: consecutive
        positions of one sequence) that runs as decode rows sharing the sequence's mirror
        slot, row j attending to the context and rows 0..j. Only the C attention kernel
        reads one length per row; the SDPA paths mask per slot."""
        q = batch.q_lens[i]
        if self._kernel is None or self.mirror is None or batch.seq_keys is None:
            return False
        drafts = batch.num_drafts[i] if batch.num_drafts is not None else 0
        return drafts == q - 1 > 0 and q <= MAX_VERIFY_ROWS

    def _plan_decode(self, batch, decode_idx, starts, dev) -> _Decode:
        ps = self.kv_cache.page_size
        ctx = [batch.ctx_lens[i] for i in decode_idx]
        q_lens = [batch.q_lens[i] for i in decode_idx]
        row_ids = [r for i in decode_idx for r in range(starts[i], starts[i + 1])]
        rows = None
        if len(row_ids) != batch.num_tokens:
            rows = torch.tensor(row_ids, dtype=torch.long, device=dev)
        if self.mirror is not None and batch.seq_keys is not None:
            keys = [batch.seq_keys[i] for i in decode_idx]
            tables = [batch.page_tables[i] for i in decode_idx]
            mirror = self.mirror.plan(keys, ctx, tables, q_lens)
            if mirror is not None:
                return _Decode(rows, None, mirror.mask, len(row_ids), mirror)
        # Pages gathered per row; the rows of a verified item (row j: context c - q + 1 + j).
        row_ctx = [c - q + 1 + j for c, q in zip(ctx, q_lens, strict=True) for j in range(q)]
        row_item = [i for i, q in zip(decode_idx, q_lens, strict=True) for _ in range(q)]
        max_pages = -(-max(row_ctx) // ps)
        flat: list[int] = []
        for i, c in zip(row_item, row_ctx, strict=True):
            table = batch.page_tables[i][: -(-c // ps)]
            flat.extend(table)
            flat.extend([0] * (max_pages - len(table)))
        lens = torch.tensor(row_ctx, device=dev)
        past = torch.arange(max_pages * ps, device=dev).unsqueeze(0) >= lens.unsqueeze(1)
        mask = torch.zeros(past.shape, dtype=COMPUTE_DTYPE, device=dev)
        mask.masked_fill_(past, float("-inf"))
        pages = torch.tensor(flat, dtype=torch.long, device=dev)
        return _Decode(rows, pages, mask.view(len(row_ctx), 1, 1, -1), len(row_ctx))

    def forward(self, layer, q, k, v, plan: TorchPlan) -> torch.Tensor:
        kc, vc = self.kv_cache.key(layer), self.kv_cache.value(layer)
        hk, d = self.num_kv_heads, self.head_dim
        dec = plan.decode
        if self._kernel is not None and dec is not None and dec.mirror is not None:
            if not plan.prefills:  # a decode-only step: one kernel pass per K/V write
                self._write_kv(self._kernel, layer, (k, v), plan.slots, dec)
                return self._decode(layer, q, kc, vc, dec)
        # Stored in the cache's dtype; everything below reads K/V as stored (rounded) and
        # computes in q's, so a chunk attends the same values whether cached or fresh.
        k, v = k.to(kc.dtype), v.to(vc.dtype)
        kc.view(-1, hk, d).index_copy_(0, plan.slots, k)
        vc.view(-1, hk, d).index_copy_(0, plan.slots, v)
        if dec is not None and dec.mirror is not None:
            mirror = self._planned_mirror()
            if dec.rows is None:
                mirror.update(layer, dec.mirror, k, v)
            else:
                mirror.update(layer, dec.mirror, k[dec.rows], v[dec.rows])
            if layer == self.kv_cache.num_layers - 1:
                mirror.finish()
        if dec is not None and not plan.prefills:
            return self._decode(layer, q, kc, vc, dec)
        out = q.new_empty(plan.num_tokens, self.num_heads * d)
        if dec is not None and dec.rows is not None:  # rows is None only with no prefills
            rows = dec.rows
            out.index_copy_(0, rows, self._decode(layer, q.index_select(0, rows), kc, vc, dec))
        for p in plan.prefills:
            out[p.start : p.end] = self._prefill(q, k, v, kc, vc, p)
        return out

    def _decode(self, layer, q, kc, vc, dec: _Decode) -> torch.Tensor:
        b, hk, d = dec.batch, self.num_kv_heads, self.head_dim
        # Query head h reads KV head h // group, so q's heads split as [hk, group].
        groups = q.reshape(b, hk, self.num_heads // hk, d)
        if dec.mirror is not None:
            return self._decode_mirror(layer, groups, dec.mirror)
        keys = kc.index_select(0, dec.pages).view(b, -1, hk, d).transpose(1, 2).to(q.dtype)
        values = vc.index_select(0, dec.pages).view(b, -1, hk, d).transpose(1, 2).to(q.dtype)
        o = F.scaled_dot_product_attention(
            groups, keys, values, attn_mask=dec.mask, scale=self.scale
        )
        return o.reshape(b, self.num_heads * d)

    def _planned_mirror(self) -> DecodeMirror:
        """The mirror, for a step whose plan reads it (only a mirror makes a MirrorPlan)."""
        if self.mirror is None:
            raise RuntimeError("attention: a step planned on a mirror this backend lacks")
        return self.mirror

    def _decode_mirror(self, layer, groups, plan: MirrorPlan) -> torch.Tensor:
        if self._kernel is not None:
            return self._kernel_attention(self._kernel, layer, groups, plan)
        mirror = self._planned_mirror()
        keys = mirror.keys(layer, plan).to(groups.dtype)
        values = mirror.values(layer, plan).to(groups.dtype)
        if not plan.identity:  # rows to their slots; unused slots attend zeros, then dropped
            slotted = groups.new_zeros((plan.width, *groups.shape[1:]))
            groups = slotted.index_copy_(0, plan.slots, groups)
        o = F.scaled_dot_product_attention(
            groups, keys, values, attn_mask=plan.mask, scale=self.scale
        )
        if not plan.identity:
            o = o.index_select(0, plan.slots)
        return o.reshape(plan.slots.shape[0], self.num_heads * self.head_dim)

    def fused_decode(self, plan: TorchPlan) -> FusedDecodeArgs | None:
        """Where a fused decode layer (model/fused_decode.py) writes and reads K/V this step,
        or None unless the step is decode-only and every row continues its mirror slot."""
        dec = plan.decode
        if self._kernel is None or dec is None or dec.mirror is None or plan.prefills:
            return None
        mp = dec.mirror
        if mp.fill_pages is not None or dec.rows is not None:
            return None
        paged, src = self._kernel_writes(plan.slots, dec)
        mirrors = self._planned_mirror()
        buffer, mirror = self.kv_cache.buffer, mirrors.layer_tensor(0, 0)
        whole = mirrors.layer_tensor(1, 0) if self.kv_cache.num_layers > 1 else None
        size = buffer.element_size()
        mirror_layer = (whole.data_ptr() - mirror.data_ptr()) if whole is not None else 0
        write_index = mp.write_index if src is not None else None  # set whenever src is
        return FusedDecodeArgs(
            buffer[0, 0].data_ptr(), buffer[0, 1].data_ptr(), buffer.stride(0) * size,
            _KV_TYPES[buffer.dtype], paged.data_ptr(), mirror.data_ptr(),
            mirrors.layer_tensor(0, 1).data_ptr(), mirror_layer,
            0 if src is None else src.shape[0], 0 if src is None else src.data_ptr(),
            0 if write_index is None else write_index.data_ptr(), mirror.stride(0),
            mirror.stride(1), mp.slots.data_ptr(), mp.lens.data_ptr(), self.scale,
        )  # fmt: skip

    def fused_done(self, plan: TorchPlan) -> None:
        """Every layer of a fused step ran: the mirror's slots are up to date."""
        self._planned_mirror().finish()

    def _kernel_writes(
        self, slots: torch.Tensor, dec: _Decode
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Flat row indices of the step's K/V writes, built once a step: paged rows
        (slot * Hk + h), and the continuing rows' token rows (None: no mirror writes).
        `dec` is the step's decode part, planned on the mirror."""
        if dec.kernel_writes is None:
            hk, mp = self.num_kv_heads, dec.mirror
            heads = torch.arange(hk, dtype=torch.long)
            paged = (slots.unsqueeze(1) * hk + heads).reshape(-1)
            src = None
            if mp is not None and mp.write_index is not None:
                src = mp.keep_rows if dec.rows is None else dec.rows[mp.keep_rows]
            dec.kernel_writes = (paged, src)
        return dec.kernel_writes

    def _write_kv(
        self,
        kernel: ctypes.CDLL,
        layer: int,
        kv_new: tuple[torch.Tensor, torch.Tensor],
        slots: torch.Tensor,
        dec: _Decode,
    ) -> None:
        """The step's new K and V into the pages and the mirror's continuing rows, rounded to
        the cache's dtype as `Tensor.to` rounds (nearest even), by `tq_scatter_heads`. `dec`
        is the step's decode part, planned on the mirror."""
        hk, d = self.num_kv_heads, self.head_dim
        kc, vc = self.kv_cache.key(layer), self.kv_cache.value(layer)
        mp, mirrors = dec.mirror, self._planned_mirror()
        if mp is None:
            raise RuntimeError("attention: a kernel K/V write without a mirror plan")
        paged, src = self._kernel_writes(slots, dec)
        kind = _KV_TYPES[kc.dtype]
        scatter = kernel.tq_scatter_heads
        for kv, new, cache in ((0, kv_new[0], kc), (1, kv_new[1], vc)):
            if new.stride(2) != 1 or new.stride(1) != d:  # rows may be strided, heads dense
                new = new.contiguous()
            scatter(new.data_ptr(), new.stride(0), new.shape[0], hk, d, None, paged.data_ptr(),
                    cache.data_ptr(), kind)  # fmt: skip
            if src is not None and mp.write_index is not None:  # both set, or neither
                mirror = mirrors.layer_tensor(layer, kv)
                scatter(new.data_ptr(), new.stride(0), src.shape[0], hk, d, src.data_ptr(),
                        mp.write_index.data_ptr(), mirror.data_ptr(), kind)  # fmt: skip
        mirrors.update(layer, mp, None, None)  # refills from the pages, if any
        if layer == self.kv_cache.num_layers - 1:
            mirrors.finish()

    def _kernel_attention(
        self, kernel: ctypes.CDLL, layer: int, groups: torch.Tensor, plan: MirrorPlan
    ) -> torch.Tensor:
        """The C kernel on the mirror as stored (any KV dtype; no padded copy, no mask)."""
        q = groups.reshape(groups.shape[0], -1).contiguous()
        out = torch.empty_like(q)
        mirror = self._planned_mirror()
        keys, values = mirror.layer_tensor(layer, 0), mirror.layer_tensor(layer, 1)
        rc = kernel.tq_decode_attention(
            q.data_ptr(), keys.data_ptr(), values.data_ptr(), _KV_TYPES[keys.dtype],
            keys.stride(0), keys.stride(1), plan.slots.data_ptr(), plan.lens.data_ptr(),
            q.shape[0], self.num_heads, self.num_kv_heads, self.head_dim, self.scale,
            out.data_ptr(),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"decode attention kernel failed ({rc})")
        return out

    def _prefill(self, q, k, v, kc, vc, p: _Prefill) -> torch.Tensor:
        hk, d = self.num_kv_heads, self.head_dim
        if p.pages is None:
            n, t = p.count, p.ctx
            qs = q[p.start : p.end].view(n, t, -1, d).transpose(1, 2)
            keys = k[p.start : p.end].view(n, t, hk, d).transpose(1, 2).to(q.dtype)
            values = v[p.start : p.end].view(n, t, hk, d).transpose(1, 2).to(q.dtype)
            o = F.scaled_dot_product_attention(
                qs, keys, values, is_causal=True, scale=self.scale, enable_gqa=True
            )
            return o.transpose(1, 2).reshape(p.end - p.start, self.num_heads * d)
        qs = q[p.start : p.end].transpose(0, 1).unsqueeze(0)
        keys = kc.index_select(0, p.pages).view(-1, hk, d)[: p.ctx].transpose(0, 1).to(q.dtype)
        values = vc.index_select(0, p.pages).view(-1, hk, d)[: p.ctx].transpose(0, 1).to(q.dtype)
        o = F.scaled_dot_product_attention(
            qs,
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=p.mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return o[0].transpose(0, 1).reshape(p.end - p.start, self.num_heads * d)
