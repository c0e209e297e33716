"""Token masks of one step's grammar-constrained rows, computed while the forward pass runs.

    pending = masks.start([matcher_or_None, ...])   # before the forward pass
    allowed = pending.result()                      # [rows, vocab] bool, or None

llguidance fills one bit per token for every constrained row at once (its executor works
on the rows in parallel and drops the GIL), on a thread of its own, so the mask is ready
by the time the logits are. Rows without a matcher allow every token.
"""

from __future__ import annotations

import concurrent.futures

import llguidance
import numpy as np
import torch
from llguidance.numpy import (
    fill_next_token_bitmask_par,
    fill_next_token_bitmask_par_with_draft_tokens,
)


class GrammarMasks:
    """Masks for logits `vocab_size` wide. One step at a time (the engine thread's)."""

    def __init__(self, vocab_size: int, num_threads: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._executor = llguidance.LLExecutor(num_threads)
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="masks")

    def start(
        self,
        matchers: list[llguidance.LLMatcher | None],
        drafts: list[list[int]] | None = None,
    ) -> concurrent.futures.Future[torch.Tensor | None]:
        """The allowed tokens of each row, as a future (None: no row is constrained).

        With `drafts` (speculation, one list per matcher) matcher i has 1 + len(drafts[i])
        rows: its mask now, then its mask after each draft in turn (the drafts must be
        ones it accepts: `validate_tokens`); the matcher itself is left as it was."""
        spans = [1 + len(d) for d in drafts] if drafts is not None else [1] * len(matchers)
        entries: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
        at = 0
        for i, (m, span) in enumerate(zip(matchers, spans, strict=True)):
            if m is not None:
                entries.append((m, at, drafts[i] if drafts is not None else []))
            at += span
        if not entries:
            done: concurrent.futures.Future[torch.Tensor | None] = concurrent.futures.Future()
            done.set_result(None)
            return done
        return self._thread.submit(self._compute, entries, at)

    def close(self) -> None:
        self._thread.shutdown(wait=False)

    def _compute(
        self, entries: list[tuple[llguidance.LLMatcher, int, list[int]]], rows: int
    ) -> torch.Tensor:
        bits = np.full((rows, self.words), -1, dtype=np.int32)
        plain = [(m, at) for m, at, d in entries if not d]
        drafted = [e for e in entries if e[2]]
        if plain:
            fill_next_token_bitmask_par(self._executor, plain, bits)
        if drafted:
            fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, bits)
        # Bit j of word w is token 32 * w + j: little-endian bytes, little bit order.
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(allowed[:, : self.vocab_size].view(np.bool_))
