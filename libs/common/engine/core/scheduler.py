"""Continuous batching with chunked prefill, prefix reuse and preemption by recompute.

The engine loop is three calls:

    out = scheduler.schedule()                  # who runs, which tokens, which pages
    sampled = runner.run(out)                   # {request_id: token} for entries with .sample
    done = scheduler.postprocess(out, sampled)  # append, commit full pages, finish

Every call must come from one thread, and `abort`/`finish`/`release` must not
run between `schedule()` and its `postprocess()` while the model may still be
writing into the pages of that step: freed pages can be handed out at once.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping

import structlog

from libs.common.engine.core.batch import ScheduledSeq, SchedulerOutput
from libs.common.engine.core.kv_hash import PageHasher
from libs.common.engine.core.kv_pages import KvPages
from libs.common.engine.core.page_allocator import PageAllocator
from libs.common.engine.core.radix_cache import RadixCache
from libs.common.engine.core.sequence import FinishReason, Sequence, SequenceStatus, pages_for

__all__ = ["ScheduledSeq", "Scheduler", "SchedulerOutput"]

log = structlog.get_logger(__name__)


class Scheduler:
    """FCFS continuous batching over one KV pool.

    Contract:
    - a step computes at most `max_num_batched_tokens` tokens for at most
      `max_num_seqs` running sequences; running decodes go first, then running
      prefill chunks, then waiting sequences are admitted in arrival order
      (the head of the queue is never overtaken);
    - at admission the longest cached prefix of full pages is reused, but
      never the whole sequence: at least one token is computed so that there
      are logits to sample from;
    - when a running sequence needs a page and neither the free list nor the
      cache's unreferenced pages have one, the most recently admitted running
      sequence is preempted: its pages are freed and it goes back to the front
      of the queue to be recomputed; no sequence is admitted in that step;
    - newly full computed pages are committed to the cache after each step; a
      page whose key is already cached is swapped for the cached copy (same key,
      same bytes), so `page_table` entries can change between steps;
    - a finished sequence frees its pages, unless it has `keep_pages`: then it
      is HELD with its pages until `release`.
    """

    def __init__(
        self,
        allocator: PageAllocator,
        *,
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        cache: RadixCache | None = None,
        hasher: PageHasher | None = None,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({max_num_seqs}) so every running sequence can decode"
            )
        self.kv = KvPages(allocator, page_size, cache, hasher)
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._seqs: dict[str, Sequence] = {}  # every sequence not yet FINISHED
        self.retired_pages = 0  # pages taken out of use for good (abort retire_pages)

    # -- queries ---------------------------------------------------------------

    def get(self, request_id: str) -> Sequence | None:
        return self._seqs.get(request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def oldest_wait(self, now: float) -> float:
        """Seconds the longest-waiting sequence has waited (`now`: time.monotonic()), each
        since it joined the queue (Sequence.queued_time)."""
        return max((now - s.queued_time for s in self.waiting), default=0.0)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_free_pages(self) -> int:
        """Pages obtainable now: free ones plus unreferenced cached ones."""
        return self.kv.num_free_pages

    # -- entry points ------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (FCFS). Raises ValueError if it could never fit."""
        self._register(seq)
        self.waiting.append(seq)

    def reserve(self, seq: Sequence, reuse_prefix: bool = False) -> list[int] | None:
        """Allocate pages for `seq`'s prompt so a peer can write its KV into them.

        Returns the page indices (in prompt order), or None when the pool cannot
        hold them now (nothing is kept). The sequence is RESERVED until
        `add_imported` (KV arrived) or `abort`. With `reuse_prefix`, the leading
        `seq.num_committed_pages` pages are this pool's cached pages of the prompt's
        prefix: they already hold the right KV, and the peer writes only the rest.
        """
        if seq.page_table or seq.num_computed_tokens:
            raise ValueError(f"{seq.request_id}: a sequence to reserve must hold no pages")
        self._register(seq)
        if reuse_prefix:
            self.kv.match_prefix(seq)
        if not self.kv.grow(seq, seq.num_prompt_tokens):
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            del self._seqs[seq.request_id]
            return None
        seq.status = SequenceStatus.RESERVED
        return list(seq.page_table)

    def add_imported(self, request_id: str, first_token_id: int) -> Sequence:
        """The prompt KV of a RESERVED sequence is in place and its first token was
        sampled elsewhere: commit its pages and queue it to decode. It is queued
        ahead of sequences that hold no pages, since it already holds its own."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.status != SequenceStatus.RESERVED:
            raise ValueError(f"{request_id}: not a reserved sequence")
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.append_token(first_token_id)
        self.kv.commit(seq)
        reason = self.stop_reason(seq)
        if reason is not None:
            self._finish(seq, reason)
            return seq
        seq.status = SequenceStatus.WAITING
        seq.queued_time = time.monotonic()  # its queue time starts now, not at its reservation
        at = next((i for i, s in enumerate(self.waiting) if not s.page_table), len(self.waiting))
        self.waiting.insert(at, seq)
        return seq

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch and give every picked sequence the pages it needs."""
        out = SchedulerOutput()
        picked: dict[str, ScheduledSeq] = {}
        budget = self.max_num_batched_tokens
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        chunks = [s for s in self.running if s.num_uncomputed_tokens > 1]
        spare = budget - len(decodes)  # for drafts, once every decode has its token
        for seq in decodes + chunks:
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            drafts = self._fit_drafts(seq, spare)
            spare -= drafts
            n = min(seq.num_uncomputed_tokens, budget) + drafts
            while not self.kv.grow(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if (undone := picked.pop(victim.request_id, None)) is not None:
                    budget += undone.num_tokens
                if victim is seq:
                    break
            if seq.status == SequenceStatus.RUNNING:
                picked[seq.request_id] = ScheduledSeq(seq, seq.num_computed_tokens, n, drafts)
                budget -= n
        # A step that had to preempt has no room to admit anyone.
        while not out.preempted and self.waiting and budget and self._has_seat():
            seq = self.waiting[0]
            chunk = self._admit(seq, budget)
            if chunk is None:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.scheduled_time is None:  # its queue time ends here (traces)
                seq.scheduled_time = time.monotonic()
            self.running.append(seq)
            picked[seq.request_id] = ScheduledSeq(seq, seq.num_computed_tokens, chunk)
            budget -= chunk
        out.scheduled = list(picked.values())
        return out

    def postprocess(self, out: SchedulerOutput, sampled: Mapping[str, int]) -> list[Sequence]:
        """Advance each scheduled sequence by its chunk, append its sampled token
        (`sampled[request_id]`, required where `.sample`), commit newly full pages
        and finish on max_tokens, a stop token id, EOS (unless ignore_eos) or
        after the first token of a prefill-only sequence. Returns the sequences
        that finished (FINISHED or HELD) in this step. Stop strings are the
        caller's: it calls `finish` when the detokenized text hits one."""
        done: list[Sequence] = []
        for item in out.scheduled:
            seq = item.seq
            if seq.status != SequenceStatus.RUNNING or seq.num_computed_tokens != item.start:
                continue  # aborted or finished since schedule()
            if item.num_drafts:
                continue  # the caller hands its verified tokens to take_verified
            seq.num_computed_tokens += item.num_tokens
            if not item.sample:
                self.kv.commit(seq)
                continue
            token = sampled.get(seq.request_id)
            if token is None:
                raise ValueError(f"{seq.request_id}: no sampled token for a sampling step")
            seq.append_token(token)
            self.kv.commit(seq)
            reason = self.stop_reason(seq)
            if reason is not None or seq.prefill_only:
                self._finish(seq, reason)
                done.append(seq)
        return done

    def take_verified(self, item: ScheduledSeq, token: int) -> bool:
        """Append the next token of a speculative item's verified run (the target's token
        at the item's next position: an accepted draft, or the last, corrective one), as
        postprocess appends a sampled token: the KV of the position before it becomes
        computed, full pages are committed, and a stop id, EOS or max_tokens finishes
        the sequence. False (nothing done) when the sequence finished or left since
        schedule(), or the item's positions are used up; the caller stops there."""
        seq = item.seq
        done = seq.num_computed_tokens - item.start
        if seq.status != SequenceStatus.RUNNING or not 0 <= done <= item.num_drafts:
            return False
        seq.num_computed_tokens += 1
        seq.append_token(token)
        self.kv.commit(seq)
        reason = self.stop_reason(seq)
        if reason is not None:
            self._finish(seq, reason)
        return True

    def end_verified(self, item: ScheduledSeq) -> None:
        """The speculative item's run is taken: drop its drafts, and the pages that
        held only rejected positions."""
        seq = item.seq
        seq.draft_ids = []
        if seq.status == SequenceStatus.RUNNING:
            self.kv.trim(seq, seq.num_computed_tokens)

    def finish(self, request_id: str, reason: FinishReason | str) -> Sequence | None:
        """End a sequence for a reason found outside (a stop string), as postprocess
        would; a no-op on one that already finished."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.is_finished:
            return seq
        self._finish(seq, FinishReason(reason))
        return seq

    def abort(self, request_id: str, retire_pages: bool = False) -> Sequence | None:
        """Drop a sequence in any state and free its pages now (a HELD one too).

        With `retire_pages` its own pages (those not shared through the prefix cache)
        are never handed out again: a peer may still be writing them (a KV handoff the
        transfer engine could not fence). They stay counted as used."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        if retire_pages:
            self.retired_pages += len(seq.page_table) - seq.num_committed_pages
            del seq.page_table[seq.num_committed_pages :]
        seq.finish_reason = seq.finish_reason or FinishReason.ABORT
        seq.keep_pages = False
        self._finish(seq, seq.finish_reason)
        return seq

    def release(self, request_id: str) -> Sequence:
        """Free the pages of a HELD sequence (its export or pool write is done)."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.status != SequenceStatus.HELD:
            raise ValueError(f"{request_id}: not a held sequence")
        self._drop(seq)
        return seq

    # -- internals -----------------------------------------------------------------

    def _register(self, seq: Sequence) -> None:
        if seq.request_id in self._seqs:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        if seq.status != SequenceStatus.WAITING:
            raise ValueError(f"{seq.request_id}: a new sequence must be WAITING")
        self._check_fits(seq)
        self._seqs[seq.request_id] = seq

    def _check_fits(self, seq: Sequence) -> None:
        # A sequence larger than the pool would preempt itself forever.
        most = seq.num_prompt_tokens + seq.sampling_params.max_tokens
        if pages_for(most, self.page_size) > self.kv.allocator.num_pages:
            raise ValueError(
                f"{seq.request_id}: {most} tokens need more pages than the pool's "
                f"{self.kv.allocator.num_pages}"
            )

    def _has_seat(self) -> bool:
        return len(self.running) < self.max_num_seqs

    def _admit(self, seq: Sequence, budget: int) -> int | None:
        """Reuse the cached prefix (sequences holding no pages), then get pages for
        the first chunk. Returns the chunk length, or None with everything undone."""
        fresh = not seq.page_table
        queried, hit = self.kv.match_prefix(seq) if fresh else (0, 0)
        n = min(seq.num_uncomputed_tokens, budget)
        if not self.kv.grow(seq, seq.num_computed_tokens + n):
            if fresh:
                self.kv.free(seq)
                seq.num_computed_tokens = 0
            return None
        if fresh and self.kv.cache is not None:
            self.kv.cache.stats.record(queried, hit)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = min(hit * self.page_size, seq.num_prompt_tokens)
        return n

    def _fit_drafts(self, seq: Sequence, spare: int) -> int:
        """How many of a decoding sequence's drafts to compute with its token: as many
        as the step's spare budget and the free pages allow; drafts never evict a cached
        page nor preempt anyone. The rest are dropped."""
        k = min(len(seq.draft_ids), spare) if seq.num_uncomputed_tokens == 1 else 0
        if k > 0:
            need = seq.num_new_pages_for(seq.num_computed_tokens + 1 + k, self.page_size)
            if need > self.kv.allocator.num_free or not self.kv.grow(
                seq, seq.num_computed_tokens + 1 + k
            ):
                k = 0
        del seq.draft_ids[k:]
        return k

    def _preempt(self, seq: Sequence) -> None:
        seq.draft_ids = []
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)
        log.info("preempted", request_id=seq.request_id, tokens=seq.num_tokens)

    def stop_reason(self, seq: Sequence) -> FinishReason | None:
        """Why `seq` ends on its last token (stop id, EOS, max_tokens), or None. Stop ids
        and EOS end it only from output token `min_tokens` on (the sampler masks them
        before; a migrated request's replayed tokens are checked here too)."""
        params, token = seq.sampling_params, seq.last_token_id
        may_stop = seq.num_output_tokens > params.min_tokens
        if may_stop and token in params.stop_token_ids:
            return FinishReason.STOP
        if may_stop and not params.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason | None) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED):
            self.waiting.remove(seq)
        seq.finish_reason = reason
        seq.draft_ids = []
        if seq.keep_pages:
            # Pages past the computed tokens hold only rejected drafts: never exported.
            self.kv.trim(seq, seq.num_computed_tokens)
            seq.status = SequenceStatus.HELD
        else:
            self._drop(seq)

    def _drop(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        self._seqs.pop(seq.request_id, None)
