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
from llguidance.numpy import fill_next_token_bitmask_par


class GrammarMasks:
    """Masks for logits `vocab_size` wide. One step at a time (the engine thread's)."""

    def __init__(self, vocab_size: int, num_threads: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._executor = llguidance.LLExecutor(num_threads)
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="masks")

    def start(
        self, matchers: list[llguidance.LLMatcher | None]
    ) -> concurrent.futures.Future[torch.Tensor | None]:
        """The allowed tokens of each row, as a future (None: no row is constrained)."""
        pairs = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if not pairs:
            done: concurrent.futures.Future[torch.Tensor | None] = concurrent.futures.Future()
            done.set_result(None)
            return done
        return self._thread.submit(self._compute, pairs, len(matchers))

    def close(self) -> None:
        self._thread.shutdown(wait=False)

    def _compute(self, pairs: list[tuple[llguidance.LLMatcher, int]], rows: int) -> torch.Tensor:
        bits = np.full((rows, self.words), -1, dtype=np.int32)
        fill_next_token_bitmask_par(self._executor, pairs, bits)
        # Bit j of word w is token 32 * w + j: little-endian bytes, little bit order.
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(allowed[:, : self.vocab_size].view(np.bool_))
