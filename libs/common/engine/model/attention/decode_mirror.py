"""A dense copy of the decoding sequences' K/V, so decode attention gathers no pages.

The paged cache stays the source of truth (the prefix cache, exports and imports
all read and write pages). The mirror holds, per layer, K and V of each decoding
sequence in its own slot, head-major: [slots, kv_heads, capacity, head_dim]. A
step's decode attention then reads `mirror[:slots_in_use, :, :longest_context]`
directly, where the paged path first copies every row's pages into a padded
batch (a large part of decode attention at 32 streams: docs/engine.md, "The decode
mirror").

A slot is trusted only while its sequence decodes in consecutive steps: the item
with key `k` keeps its slot when the previous step had `k` as a decode item and this
item starts where that one's computed positions may end, with the same first page.
An item is one row, or (speculative verification) q consecutive positions of one
sequence sharing its slot: row j attends to the context plus rows 0..j. After a
verification of q rows ending at context c, the next item may start anywhere in
c - q + 1 .. c (the accepted drafts are the sequence's tokens; the rejected
positions past the next start are never read: each row reads its own length, and
they are overwritten as the sequence grows). Anything else (a new
decoder, a prefill chunk in between, a preemption, a context that did not grow
by exactly one, a step whose forward did not finish every layer) refills the
slot from the pages, which the step has already written. Growing the slot count
or the capacity drops every slot (all rows refill once, one gather as before).

Memory: the mirror is never larger than the paged cache; a step that would need
more goes without it (`plan` returns None and the caller gathers pages).
"""

from __future__ import annotations

import dataclasses

import structlog
import torch

from libs.common.engine.model.kv_cache import KVCache

# Attention computes in the model's activation type, whatever the KV cache stores.
COMPUTE_DTYPE = torch.float32

log = structlog.get_logger(__name__)

CAPACITY_STEP = 128  # tokens; capacity grows in these steps (a multiple of every page size used)


@dataclasses.dataclass(slots=True)
class MirrorPlan:
    """One step's use of the mirror, shared by every layer."""

    width: int  # slots covered by attention this step: [0, width)
    length: int  # longest context among the step's decode rows
    slots: torch.Tensor  # [B] slot of each decode row, row order (an item's rows share one)
    identity: bool  # slots == arange(B) and width == B: no scatter/gather of q needed
    write_index: torch.Tensor | None  # [n_keep * Hk] flat rows of the continuing rows' new K/V
    keep_rows: torch.Tensor | None  # [n_keep] decode-row indices that continue their slot
    fill_slots: torch.Tensor | None  # [n_fill] slots refilled from pages this step (per item)
    fill_pages: torch.Tensor | None  # [n_fill * fill_pages_each] page ids, padded with page 0
    fill_tokens: int  # tokens gathered per refilled row (a whole number of pages)
    mask: torch.Tensor  # [width, 1, 1, length]: 0 attended, -inf past a slot's context
    lens: torch.Tensor  # [B] int32: each decode row's context length, row order


class DecodeMirror:
    """Slot bookkeeping (pure Python) plus the mirror tensor of one KV cache.

    Contract: call `plan(keys, ctx_lens, page_tables)` once per step with the
    step's decode rows (row order); then, for every layer, after the step's new
    K/V are in the paged cache, `update(layer, plan, k_rows, v_rows)` with those
    rows' new K/V [B, Hk, D]; `keys(layer, plan)` / `values(layer, plan)` are
    then the [width, Hk, length, D] views attention reads. `finish()` marks the
    step complete; a plan made without it drops every slot first. Call
    `forget()` for a step that has no decode rows.
    """

    def __init__(self, kv_cache: KVCache) -> None:
        self.kv_cache = kv_cache
        self._tensor: torch.Tensor | None = None  # [L, 2, S, Hk, capacity, D]
        # key -> (slot, first possible next start, context, first page) as of the last step
        self._slots: dict[int, tuple[int, int, int, int]] = {}
        self._complete = True

    @property
    def num_slots(self) -> int:
        return 0 if self._tensor is None else self._tensor.shape[2]

    @property
    def capacity(self) -> int:
        return 0 if self._tensor is None else self._tensor.shape[4]

    def finish(self) -> None:
        self._complete = True

    def forget(self) -> None:
        """Trust no slot any more (a step without decode rows breaks every run)."""
        self._slots.clear()

    def drop(self) -> None:
        """Forget every slot and free the memory."""
        self._tensor = None
        self.forget()

    def plan(
        self,
        keys: list[int],
        ctx_lens: list[int],
        page_tables: list[list[int]],
        q_lens: list[int] | None = None,
    ) -> MirrorPlan | None:
        """One plan for the step's decode items (one key each; `q_lens` rows each, default
        1; an item of several rows must continue its slot: see `continues`)."""
        q_lens = q_lens if q_lens is not None else [1] * len(keys)
        if not self._complete:
            self.forget()
        self._complete = False
        if len(set(keys)) != len(keys):
            self.drop()
            return None
        if not self._fits(len(keys), max(ctx_lens)):
            self.drop()
            return None
        keep, fill = [], []
        slot_of: dict[int, int] = {}
        items = zip(keys, ctx_lens, page_tables, q_lens, strict=True)
        for item, (key, ctx, table, q) in enumerate(items):
            if self.continues(key, ctx - q, table[0]):
                slot_of[key] = self._slots[key][0]
                keep.append(item)
            else:
                fill.append(item)
        used = set(slot_of.values())
        free = (s for s in range(self.num_slots) if s not in used)
        for item in fill:
            slot_of[keys[item]] = next(free)
        if max(slot_of.values()) + 1 > 2 * len(keys):
            # Mostly empty slots in the attended width: refill every item into slots 0.. instead.
            keep, fill = [], list(range(len(keys)))
            slot_of = {key: item for item, key in enumerate(keys)}
        self._slots = {
            key: (slot_of[key], ctx - q + 1, ctx, table[0])
            for key, ctx, table, q in zip(keys, ctx_lens, page_tables, q_lens, strict=True)
        }
        slots = [slot_of[key] for key in keys]
        return self._make_plan(slots, (ctx_lens, q_lens), page_tables, keep, fill)

    def continues(self, key: int, start: int, first_page: int) -> bool:
        """Whether the item of `key` whose new rows start at position `start` continues its
        slot: the last step had `key` as a decode item after which `start` positions may be
        computed, with the same first page (positions < start are then in the slot)."""
        last = self._slots.get(key)
        return last is not None and last[1] <= start <= last[2] and last[3] == first_page

    def slot_of(self, key: int) -> int | None:
        """The slot `key` holds after the last plan, or None."""
        last = self._slots.get(key)
        return None if last is None else last[0]

    def _fits(self, rows: int, longest: int) -> bool:
        """Grow the mirror if needed; False when it would outgrow the paged cache."""
        if rows <= self.num_slots and longest <= self.capacity:
            return True
        c = self.kv_cache
        slots = max(rows, self.num_slots)
        capacity = max(self.capacity, -(-longest // CAPACITY_STEP) * CAPACITY_STEP)
        capacity = -(-capacity // c.page_size) * c.page_size
        shape = (c.num_layers, 2, slots, c.num_kv_heads, capacity, c.head_dim)
        if torch.Size(shape).numel() > c.buffer.numel():
            if self._tensor is not None:
                log.info("decode_mirror.off", rows=rows, longest=longest, reason="pool size")
            return False
        self.drop()
        self._tensor = torch.zeros(shape, dtype=c.buffer.dtype, device=c.buffer.device)
        nbytes = self._tensor.numel() * self._tensor.element_size()
        log.info("decode_mirror.grown", slots=slots, capacity=capacity, mib=nbytes >> 20)
        return True

    def _make_plan(self, slots, lens_q, page_tables, keep, fill) -> MirrorPlan:
        """`slots`, `keep` and `fill` are per item; the plan's rows expand each item into
        its q rows (row j of an item ending at context c: context c - q + 1 + j)."""
        dev = self.kv_cache.buffer.device
        hk, cap, ps = self.kv_cache.num_kv_heads, self.capacity, self.kv_cache.page_size
        ctx_lens, q_lens = lens_q
        first = [0]
        for q in q_lens:
            first.append(first[-1] + q)
        row_slots = [s for s, q in zip(slots, q_lens, strict=True) for _ in range(q)]
        row_ctx = [c - q + 1 + j for c, q in zip(ctx_lens, q_lens, strict=True) for j in range(q)]
        width = max(slots) + 1
        length = max(ctx_lens)
        mask = torch.zeros(width, length, dtype=COMPUTE_DTYPE, device=dev)
        lens = [0] * width
        for slot, ctx in zip(slots, ctx_lens, strict=True):
            lens[slot] = ctx
        for slot, n in enumerate(lens):
            if 0 < n < length:
                mask[slot, n:] = float("-inf")
        write_index = keep_rows = None
        if keep:
            rows = [r for i in keep for r in range(first[i], first[i + 1])]
            flat = [(row_slots[r] * hk + h) * cap + row_ctx[r] - 1 for r in rows for h in range(hk)]
            write_index = torch.tensor(flat, dtype=torch.long, device=dev)
            keep_rows = torch.tensor(rows, dtype=torch.long, device=dev)
        fill_slots = fill_pages = None
        fill_tokens = 0
        if fill:
            n_pages = -(-max(ctx_lens[i] for i in fill) // ps)
            pages: list[int] = []
            for i in fill:
                table = page_tables[i][: -(-ctx_lens[i] // ps)]
                pages.extend(table)
                pages.extend([0] * (n_pages - len(table)))
            fill_tokens = n_pages * ps
            fill_slots = torch.tensor([slots[i] for i in fill], dtype=torch.long, device=dev)
            fill_pages = torch.tensor(pages, dtype=torch.long, device=dev)
        identity = width == len(row_slots) and row_slots == list(range(width))
        return MirrorPlan(
            width=width,
            length=length,
            slots=torch.tensor(row_slots, dtype=torch.long, device=dev),
            identity=identity,
            write_index=write_index,
            keep_rows=keep_rows,
            fill_slots=fill_slots,
            fill_pages=fill_pages,
            fill_tokens=fill_tokens,
            mask=mask.view(width, 1, 1, length),
            lens=torch.tensor(row_ctx, dtype=torch.int32),
        )

    def update(self, layer: int, plan: MirrorPlan, k_rows, v_rows):
        """Bring the step's slots up to date for `layer` (pages must already hold the new K/V).
        With k_rows and v_rows None the caller has written the continuing rows itself (at
        `write_index`); only the refills from pages are done here."""
        assert self._tensor is not None
        c = self.kv_cache
        hk, d = c.num_kv_heads, c.head_dim
        for kv, paged, new in ((0, c.key(layer), k_rows), (1, c.value(layer), v_rows)):
            mirror = self._tensor[layer, kv]
            if plan.write_index is not None and new is not None:
                rows = new.index_select(0, plan.keep_rows).reshape(-1, d).to(mirror.dtype)
                mirror.view(-1, d).index_copy_(0, plan.write_index, rows)
            if plan.fill_pages is not None and plan.fill_slots is not None:  # set together
                n = plan.fill_slots.shape[0]
                gathered = paged.index_select(0, plan.fill_pages).view(n, -1, hk, d)
                target = mirror.narrow(2, 0, plan.fill_tokens)
                target.index_copy_(0, plan.fill_slots, gathered.transpose(1, 2))

    def layer_tensor(self, layer: int, kv: int) -> torch.Tensor:
        """The whole mirror of one layer's K (kv=0) or V (1): [slots, Hk, capacity, D]."""
        assert self._tensor is not None
        return self._tensor[layer, kv]

    def keys(self, layer: int, plan: MirrorPlan) -> torch.Tensor:
        assert self._tensor is not None
        return self._tensor[layer, 0, : plan.width, :, : plan.length]

    def values(self, layer: int, plan: MirrorPlan) -> torch.Tensor:
        assert self._tensor is not None
        return self._tensor[layer, 1, : plan.width, :, : plan.length]
