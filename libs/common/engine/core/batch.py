"""One step's batch as the scheduler hands it out: which tokens of which sequences."""

from __future__ import annotations

import dataclasses

from libs.common.engine.core.sequence import Sequence


@dataclasses.dataclass(slots=True)
class ScheduledSeq:
    """Compute `token_ids` (= seq.token_ids[start:start + num_tokens]) at positions
    start, start+1, ...; the KV of position p goes to page seq.page_table[p // page_size],
    slot p % page_size, and attention covers positions 0..p. When `sample` is set the
    chunk reaches the last known token and one token is sampled from its last
    position; otherwise it is a non-final prefill chunk and its logits are unused.

    With `num_drafts` (speculation) the chunk is the last known token followed by the
    first `num_drafts` of `seq.draft_ids`, and every one of its positions is sampled: the
    KV of the drafts' positions is valid only for the drafts the caller accepts
    (`Scheduler.take_verified`)."""

    seq: Sequence
    start: int
    num_tokens: int
    num_drafts: int = 0
    sample: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.sample = self.start + self.num_tokens - self.num_drafts == self.seq.num_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.start >= self.seq.num_prompt_tokens

    @property
    def token_ids(self) -> list[int]:
        if self.num_drafts:
            return [self.seq.last_token_id, *self.seq.draft_ids[: self.num_drafts]]
        return self.seq.token_ids[self.start : self.start + self.num_tokens]

    @property
    def drafts(self) -> list[int]:
        return self.seq.draft_ids[: self.num_drafts]


@dataclasses.dataclass(slots=True)
class SchedulerOutput:
    """One step's batch (decodes first, then prefill chunks) and who was preempted."""

    scheduled: list[ScheduledSeq] = dataclasses.field(default_factory=list)
    preempted: list[Sequence] = dataclasses.field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
