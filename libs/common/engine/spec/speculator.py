"""When to speculate and how far: the draft length per request follows its acceptance.

    speculator.draft(running)            # before schedule(): seq.draft_ids set or emptied
    speculator.verified(seq, p, a)       # after verification: p proposed, a accepted
    speculator.release(request_id)       # the request is gone

Policy (pure Python, no torch):
- no drafts while more than `max_batch` sequences run: a step then computes enough
  tokens that the verified drafts cost more than the steps they save;
- per request, the draft length starts at half the maximum, grows by 2 while every draft
  is accepted, and drops to one more than the accepted count on a rejection;
- an exponential average of accepted/proposed below LOW_ACCEPTANCE turns drafting off
  for that request for a while (4 steps, doubling up to 64 each time it happens again),
  then it tries again with a short draft.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from libs.common.engine.config import EngineConfig
from libs.common.engine.core.sequence import Sequence, SequenceStatus
from libs.common.engine.spec.ngram import NgramProposer
from libs.common.engine.spec.proposer import Proposer

MAX_BATCH = 8  # running sequences above which no step drafts
LOW_ACCEPTANCE = 0.3  # average accepted fraction below which a request pauses drafting
EMA_WEIGHT = 0.3  # weight of the last step in the average
MAX_PAUSE = 64  # steps


@dataclasses.dataclass(slots=True)
class _State:
    k: int
    acceptance: float = 0.5
    pause: int = 0  # steps left without drafting
    backoff: int = 4  # the next pause's length


class Speculator:
    """Owns a Proposer and the per-request draft length. One caller (the engine thread)."""

    def __init__(self, proposer: Proposer, max_draft: int, max_batch: int = MAX_BATCH) -> None:
        if max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {max_draft}")
        self.proposer = proposer
        self.max_draft = max_draft
        self.max_batch = max_batch
        self._states: dict[str, _State] = {}
        self.num_proposed = 0  # totals, for logs and tests
        self.num_accepted = 0

    def draft(self, running: list[Sequence]) -> None:
        """Set `draft_ids` of each running decoding sequence (empty: no draft this step)."""
        crowded = len(running) > self.max_batch
        wanted: list[tuple[Sequence, int]] = []
        for seq in running:
            seq.draft_ids = []
            if crowded or not _may_draft(seq):
                continue
            state = self._states.get(seq.request_id)
            if state is None:
                state = self._states[seq.request_id] = _State((self.max_draft + 1) // 2)
            if state.pause:
                state.pause -= 1
                continue
            # The last output token comes from the verification itself: never draft past
            # max_tokens.
            left = seq.sampling_params.max_tokens - seq.num_output_tokens - 1
            k = min(state.k, left)
            if k > 0:
                wanted.append((seq, k))
        # A proposer that drafts for several requests at once (a draft model: one batched
        # forward a draft position) gets them together.
        many = getattr(self.proposer, "propose_many", None)
        if many is not None and wanted:
            drafts = many([(seq.request_id, seq.token_ids, k) for seq, k in wanted])
        else:
            drafts = [self.proposer.propose(seq.request_id, seq.token_ids, k) for seq, k in wanted]
        for (seq, k), ids in zip(wanted, drafts, strict=True):
            seq.draft_ids = ids[:k]

    def verified(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """`accepted` of the `proposed` drafts held (the sequence has its new tokens)."""
        self.proposer.accepted(seq.request_id, seq.num_tokens)
        state = self._states.get(seq.request_id)
        if state is None or proposed == 0:
            return
        self.num_proposed += proposed
        self.num_accepted += accepted
        rate = accepted / proposed
        state.acceptance += EMA_WEIGHT * (rate - state.acceptance)
        if accepted == proposed:
            state.k = min(self.max_draft, state.k + 2)
        else:
            state.k = max(1, min(state.k, accepted + 1))
        if state.acceptance < LOW_ACCEPTANCE:
            state.pause, state.backoff = state.backoff, min(MAX_PAUSE, 2 * state.backoff)
            state.k, state.acceptance = min(2, self.max_draft), 0.5

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self.proposer.release(request_id)


def _may_draft(seq: Sequence) -> bool:
    """A running sequence that decodes (one uncomputed token) and wants no prompt scores."""
    return (
        seq.status == SequenceStatus.RUNNING
        and seq.num_uncomputed_tokens == 1
        and not seq.prefill_only
        and seq.logits_from is None
    )


def make_speculator(
    config: EngineConfig, target: tuple[Any, Any] | None = None, pool_tokens: int = 0
) -> Speculator | None:
    """The speculator `config.speculation` names, or None ("off"). "draft" loads
    `config.draft_model` for `target` (the engine's model and tokenizer; ValueError when
    their vocabularies differ) with a KV pool of `pool_tokens` (the target's)."""
    if config.speculation == "ngram":
        return Speculator(NgramProposer(), config.speculation_max_draft)
    if config.speculation == "draft" and config.draft_model:
        if target is None:
            raise ValueError("speculation 'draft' needs the target model to check the draft")
        from libs.common.engine.spec.draft_load import load_draft_proposer  # torch

        proposer = load_draft_proposer(
            config.draft_model,
            target,
            weights=config.weights,
            max_requests=config.max_num_seqs,
            max_tokens=max(pool_tokens, config.page_size),
            page_size=config.page_size,
            chunk_tokens=config.max_num_batched_tokens,
        )
        return Speculator(proposer, config.speculation_max_draft)
    return None
