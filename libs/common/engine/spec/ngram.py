"""Drafts by n-gram lookup in the request's own tokens (prompt lookup decoding).

Text that quotes its input (a summary, an edit of code, a repeated paragraph) continues
the way an earlier passage did: when the last n tokens (n = 4 down to 1, the longest
first) occurred before, the draft is what followed their latest earlier occurrence.

The index is incremental: per request and per n, a dict from each n-gram to the
position right after its latest occurrence, extended by the tokens appended since the
last call, so a step costs O(new tokens), never O(sequence length). Only the tokens the
caller passes (accepted ones) are indexed; drafts never are, so a rejection leaves
nothing to undo.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

MAX_NGRAM = 4  # longest suffix looked up
MIN_NGRAM = 1  # shortest; a one-token match drafts too (acceptance tunes the length)


@dataclasses.dataclass(slots=True)
class _Index:
    # by n: n-gram -> position of the token that followed its latest occurrence
    follows: list[dict[tuple[int, ...], int]]
    indexed: int = 1  # positions < indexed have been added as continuations


class NgramProposer:
    """A Proposer (spec/proposer.py) drafting from the request's prompt and output."""

    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._index: dict[str, _Index] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        length = len(token_ids)
        if k <= 0 or length < 2:
            return []
        index = self._extend(request_id, token_ids)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            at = index.follows[n - 1].get(tuple(token_ids[length - n :]))
            if at is not None:
                return _continue(token_ids, at, k)
        return []

    def accepted(self, request_id: str, num_tokens: int) -> None:
        index = self._index.get(request_id)
        if index is not None and index.indexed > num_tokens:
            del self._index[request_id]  # shorter than indexed: rebuilt on the next call

    def release(self, request_id: str) -> None:
        self._index.pop(request_id, None)

    def _extend(self, request_id: str, token_ids: Sequence[int]) -> _Index:
        index = self._index.get(request_id)
        if index is None:
            index = self._index[request_id] = _Index([{} for _ in range(self.max_ngram)])
        length = len(token_ids)
        if index.indexed >= length:
            return index
        # Position p follows the n-gram token_ids[p - n : p]; later positions overwrite
        # earlier ones, so a lookup finds the latest occurrence.
        lo = max(0, index.indexed - self.max_ngram)
        window = list(token_ids[lo:length])
        for p in range(index.indexed, length):
            for n in range(1, min(self.max_ngram, p) + 1):
                index.follows[n - 1][tuple(window[p - n - lo : p - lo])] = p
        index.indexed = length
        return index


def _continue(token_ids: Sequence[int], at: int, k: int) -> list[int]:
    """k tokens from position `at` on; past the end the draft repeats itself (a match
    `d` tokens back means a period of `d`)."""
    length = len(token_ids)
    draft: list[int] = []
    for i in range(k):
        p = at + i
        draft.append(token_ids[p] if p < length else draft[p - length])
    return draft
