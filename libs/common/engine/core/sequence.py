"""One request's state inside an engine: tokens, KV pages, progress.

Lifecycle (the scheduler is the only one that moves a sequence):

    add()                 schedule()              postprocess()/finish()
    ----> WAITING ------------------> RUNNING ------------------------> FINISHED
            ^  ^                        |  |                         (pages freed)
            |  +--- preempted: pages ---+  |  keep_pages / prefill_only
            |       freed, recompute       +-----------------------> HELD
            |                                                 release() -> FINISHED
    reserve() -> RESERVED --add_imported()--> WAITING (KV already computed)

PREEMPTED is WAITING after a preemption (counted in num_preemptions).
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Sequence as SequenceT

from libs.common.engine.core.sampling_params import SamplingParams


class SequenceStatus(enum.StrEnum):
    WAITING = "waiting"
    PREEMPTED = "preempted"
    RESERVED = "reserved"
    RUNNING = "running"
    HELD = "held"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    """Why generation ended; the values are OpenAI's `finish_reason` strings."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


_UIDS = itertools.count()


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold the KV of `num_tokens` tokens."""
    return -(-num_tokens // page_size)


class Sequence:
    """A request's tokens and KV bookkeeping.

    - `token_ids` is prompt + output; the KV of `token_ids[:num_computed_tokens]`
      is in the pages of `page_table` (page i holds tokens i*page_size ...);
    - `page_table[:num_committed_pages]` are pages owned by the prefix cache and
      referenced by this sequence (keys `page_keys[:num_committed_pages]`);
      the rest are this sequence's own;
    - `num_cached_tokens` counts prompt tokens served from the prefix cache at
      first admission (for `usage`); it does not change on recompute;
    - `prefill_only`: stop after the first sampled token (a prefill worker);
    - `keep_pages`: on finish go to HELD and keep the pages until released
      (export to a decode worker, write to the pool). prefill_only implies it;
    - `logits_from`: the first prompt position whose logits are wanted besides the last
      (prompt logprobs), or None. The prefix cache is read up to it only, and the model
      runner scores positions logits_from .. num_prompt_tokens - 2 as it computes them;
    - `draft_ids`: speculative tokens proposed to follow `token_ids` this step (engine.spec);
      the scheduler computes them with the last token, and they never enter `token_ids`
      unless verification accepts them.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: SequenceT[int],
        sampling_params: SamplingParams | None = None,
        *,
        prefill_only: bool = False,
        keep_pages: bool = False,
        arrival_time: float | None = None,
    ) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt_token_ids must not be empty")
        self.request_id = request_id
        self.uid = next(_UIDS)  # unique in this process, never reused (request ids may be)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.sampling_params = sampling_params or SamplingParams()
        self.prefill_only = prefill_only
        self.keep_pages = keep_pages or prefill_only
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # time.monotonic() it joined the waiting queue: its arrival, or (a prompt whose KV
        # came from a prefill worker) the moment that KV was in place (Scheduler.add_imported)
        self.queued_time = self.arrival_time
        self.scheduled_time: float | None = None  # time.monotonic() of its first step
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.page_table: list[int] = []
        self.page_keys: list[str] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_committed_pages = 0
        self.num_preemptions = 0
        self.logits_from: int | None = None
        self.draft_ids: list[int] = []

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, pages={len(self.page_table)})"
        )

    @property
    def queue_time(self) -> float | None:
        """Seconds from joining the queue to its first step (None before that step)."""
        if self.scheduled_time is None:
            return None
        return self.scheduled_time - self.queued_time

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.HELD)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def num_new_pages_for(self, num_tokens: int, page_size: int) -> int:
        """Pages to add to `page_table` so it holds the KV of `num_tokens` tokens."""
        return max(0, pages_for(num_tokens, page_size) - len(self.page_table))
