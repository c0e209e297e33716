"""Draft tokens from a small draft model of the target's tokenizer, proposed greedily.

`DraftModelProposer` runs its own `LlamaModel` over its own paged KV pool (the engine's
`KVCache`, `PageAllocator` and torch attention backend, decode mirror included), so a
draft step is the engine's own forward pass on a smaller model, and a proposal costs k
forwards of the draft: the tokens accepted since the request's last proposal, then one
token at a time. `propose_many` proposes for several requests at once, each forward a
batch of all of them (the first proposal of a request prefills its prompt in chunks of
`chunk_tokens`).

Per request it keeps the tokens whose K/V its pages hold. `propose` first compares them
with the request's tokens and keeps only the common prefix (so a rollback it was not told
of still never reads wrong K/V), then extends; `accepted(n)` drops the K/V of drafts the
target rejected. Memory is bounded: at most `max_requests` requests and `max_tokens`
tokens of K/V; when either runs out, the request proposed longest ago loses its K/V (it
recomputes them at its next proposal), and a request that alone needs more than the pool
gets no draft.

Not thread-safe: the engine thread calls it, like the rest of the step loop.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Sequence

import structlog
import torch

from libs.common.engine.core.page_allocator import PageAllocator
from libs.common.engine.model.attention import AttentionBatch
from libs.common.engine.model.attention.torch_backend import TorchAttention
from libs.common.engine.model.fused import argmax
from libs.common.engine.model.kv_cache import KVCache
from libs.common.engine.model.model import LlamaModel

log = structlog.get_logger(__name__)

# New tokens of a request up to which they run in its first draft step (one forward with
# the other requests' steps); a longer run is computed before, in chunks.
SHORT_RUN = 16


@dataclasses.dataclass(slots=True)
class _DraftSeq:
    """One request's K/V in the draft pool: `tokens[p]`'s K/V is at position p."""

    uid: int  # the attention backend's sequence key, never reused
    tokens: list[int] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class DraftStats:
    """Counters since start: what the draft model computed and why."""

    proposals: int = 0  # propose calls that returned tokens
    proposed_tokens: int = 0
    computed_tokens: int = 0  # tokens run through the draft model (prefix and drafts)
    rolled_back_tokens: int = 0  # K/V dropped by `accepted` or a changed prefix
    evictions: int = 0  # requests whose K/V was dropped to make room
    forwards: int = 0  # forward passes of the draft model


class DraftModelProposer:
    """A `Proposer` (spec/proposer.py) backed by a draft model; see the module docstring.

    `vocab_limit`: drafts are chosen among ids below it (the target's vocabulary when the
    draft's embedding rows are padded further); None: the draft's whole vocabulary.
    """

    def __init__(
        self,
        model: LlamaModel,
        *,
        max_requests: int,
        max_tokens: int,
        page_size: int = 16,
        chunk_tokens: int = 2048,
        vocab_limit: int | None = None,
    ) -> None:
        for name, value in (("max_requests", max_requests), ("max_tokens", max_tokens),
                            ("page_size", page_size), ("chunk_tokens", chunk_tokens)):  # fmt: skip
            if value < 1:
                raise ValueError(f"draft: {name} must be >= 1, got {value}")
        c = model.config
        self.model = model
        self.page_size, self.chunk_tokens = page_size, chunk_tokens
        self.max_requests = max_requests
        self.vocab_limit = min(vocab_limit or c.vocab_size, c.vocab_size)
        num_pages = -(-max_tokens // page_size)
        self.kv_cache = KVCache(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim)
        self.attention = TorchAttention(self.kv_cache, c.num_heads)
        self.pages = PageAllocator(num_pages)
        self.stats = DraftStats()
        self._seqs: collections.OrderedDict[str, _DraftSeq] = collections.OrderedDict()
        self._uids = itertools.count()

    # -- the Proposer interface -----------------------------------------------------

    def propose(self, request_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens the draft model generates greedily after `token_ids`."""
        return self.propose_many([(request_id, token_ids, k)])[0]

    def propose_many(self, requests: list[tuple[str, Sequence[int], int]]) -> list[list[int]]:
        """`propose` for several requests (distinct ids) at once: each forward of the draft
        model computes a step of all of them (a batch of one-token rows), so k drafts for n
        requests cost k batched forwards, not n * k single ones. Same tokens as one by one."""
        if len({rid for rid, _, _ in requests}) != len(requests):
            raise ValueError("draft: a request appears twice in one proposal")
        protected = {rid for rid, _, _ in requests}
        ready: list[tuple[int, _DraftSeq, list[int], int]] = []  # index, seq, pending, k
        for i, (rid, token_ids, k) in enumerate(requests):
            prepared = self._prepare(rid, token_ids, k, protected)
            if prepared is not None:
                seq, k = prepared
                ready.append((i, seq, list(token_ids[len(seq.tokens) :]), k))
        # A long run of new tokens (a prompt) first, in chunks; a short one (the last
        # proposal's accepted drafts and the target's token) joins the first draft step.
        self._catch_up([(seq, pending[:-1]) for _, seq, pending, _ in ready
                        if len(pending) > SHORT_RUN])  # fmt: skip
        drafts: list[list[int]] = [[] for _ in requests]
        rows = [(i, seq, pending if len(pending) <= SHORT_RUN else pending[-1:], k)
                for i, seq, pending, k in ready]  # fmt: skip
        while rows:
            tokens = self._step([(seq, run) for _, seq, run, _ in rows])
            for (i, _, _, _), token in zip(rows, tokens, strict=True):
                drafts[i].append(token)
            rows = [(i, seq, drafts[i][-1:], k) for i, seq, _, k in rows if len(drafts[i]) < k]
        for i, _, _, _ in ready:
            self.stats.proposals += 1
            self.stats.proposed_tokens += len(drafts[i])
        return drafts

    def accepted(self, request_id: str, num_tokens: int) -> None:
        """The request is `num_tokens` long: K/V of positions past it is dropped."""
        seq = self._seqs.get(request_id)
        if seq is not None and num_tokens < len(seq.tokens):
            self._truncate(seq, max(num_tokens, 0))

    def release(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.pages.free(seq.pages)

    # -- bookkeeping ----------------------------------------------------------------

    @property
    def num_requests(self) -> int:
        return len(self._seqs)

    def cached_tokens(self, request_id: str) -> int:
        """Tokens of `request_id` whose K/V the draft pool holds (0 when unknown)."""
        seq = self._seqs.get(request_id)
        return len(seq.tokens) if seq is not None else 0

    def _prepare(
        self, request_id: str, token_ids: Sequence[int], k: int, protected: set[str]
    ) -> tuple[_DraftSeq, int] | None:
        """The request's state with K/V of a prefix of `token_ids` (at least one token
        left to run) and pages for k drafts after them, and k capped by the draft's
        context; None: no draft for it (empty, too long, or no room beside `protected`)."""
        k = min(k, self.model.config.max_position - len(token_ids) + 1)
        if k < 1 or not token_ids:
            return None
        need = -(-(len(token_ids) + k - 1) // self.page_size)
        if need > self.pages.num_pages:
            self.release(request_id)  # never fits: nobody else is evicted for it
            log.info("draft.too_long", request_id=request_id, tokens=len(token_ids),
                     pool_tokens=self.pages.num_pages * self.page_size)  # fmt: skip
            return None
        seq = self._seqs.get(request_id)
        if seq is None:
            if len(self._seqs) >= self.max_requests and not self._evict(protected):
                return None
            seq = self._seqs[request_id] = _DraftSeq(next(self._uids))
        self._seqs.move_to_end(request_id)
        self._keep_common_prefix(seq, token_ids)
        if len(seq.tokens) == len(token_ids):  # its logits are needed: recompute the last
            self._truncate(seq, len(token_ids) - 1)
        if max(token_ids[len(seq.tokens) :]) >= self.model.config.vocab_size:
            return None  # an id the draft cannot embed (a target's padded vocabulary)
        need -= len(seq.pages)
        while not self.pages.can_alloc(need):
            if not self._evict(protected):
                return None
        seq.pages.extend(self.pages.alloc(need) or [])
        return seq, k

    def _evict(self, protected: set[str]) -> bool:
        """Drop the K/V of the request proposed longest ago outside `protected`; False when
        there is none."""
        victim = next((rid for rid in self._seqs if rid not in protected), None)
        if victim is None:
            return False
        seq = self._seqs.pop(victim)
        self.pages.free(seq.pages)
        self.stats.evictions += 1
        log.debug("draft.evicted", request_id=victim, tokens=len(seq.tokens))
        return True

    def _keep_common_prefix(self, seq: _DraftSeq, token_ids: Sequence[int]) -> None:
        n = min(len(seq.tokens), len(token_ids))
        if seq.tokens[:n] == list(token_ids[:n]):
            if n < len(seq.tokens):
                self._truncate(seq, n)
            return
        same = next(i for i in range(n) if seq.tokens[i] != token_ids[i])
        self._truncate(seq, same)

    def _truncate(self, seq: _DraftSeq, length: int) -> None:
        """Forget K/V from position `length` on; pages past it go back to the pool."""
        self.stats.rolled_back_tokens += len(seq.tokens) - length
        del seq.tokens[length:]
        keep = -(-length // self.page_size)
        self.pages.free(seq.pages[keep:])
        del seq.pages[keep:]

    # -- the draft model ------------------------------------------------------------

    def _catch_up(self, work: list[tuple[_DraftSeq, list[int]]]) -> None:
        """Run each sequence's tokens (no logits needed) in forwards of at most
        `chunk_tokens` tokens, several sequences a forward, one piece of each."""
        work = [(seq, tokens) for seq, tokens in work if tokens]
        while work:
            budget, batch, rest = self.chunk_tokens, [], []
            for seq, tokens in work:
                take = min(len(tokens), budget)
                if take:
                    batch.append((seq, tokens[:take]))
                    budget -= take
                if take < len(tokens):
                    rest.append((seq, tokens[take:]))
            self._forward(batch)
            work = rest

    def _step(self, rows: list[tuple[_DraftSeq, list[int]]]) -> list[int]:
        """One forward of `rows` (each continuing its sequence); the greedy token after
        each row's last token."""
        hidden = self._forward(rows)
        logits = self.model.logits(hidden)[:, : self.vocab_limit]
        return argmax(logits).tolist()

    @torch.inference_mode()
    def _forward(self, rows: list[tuple[_DraftSeq, list[int]]]) -> torch.Tensor:
        """Compute `rows` (each following its seq.tokens) in one forward; their K/V join
        the pages. Returns the hidden state of each row's last token, [rows, hidden]."""
        ids: list[int] = []
        positions: list[int] = []
        q_lens, ctx_lens, last = [], [], []
        for seq, tokens in rows:
            start = len(seq.tokens)
            ids += tokens
            positions += range(start, start + len(tokens))
            q_lens.append(len(tokens))
            ctx_lens.append(start + len(tokens))
            last.append(len(ids) - 1)
        tables, keys = [seq.pages for seq, _ in rows], [seq.uid for seq, _ in rows]
        plan = self.attention.plan(AttentionBatch(q_lens, ctx_lens, tables, keys))
        hidden = self.model.forward(
            torch.tensor(ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            self.attention,
            plan,
        )
        for seq, tokens in rows:
            seq.tokens.extend(tokens)
        self.stats.computed_tokens += len(ids)
        self.stats.forwards += 1
        if len(last) == hidden.shape[0]:
            return hidden
        return hidden.index_select(0, torch.tensor(last, dtype=torch.long))
