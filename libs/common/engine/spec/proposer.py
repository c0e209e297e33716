"""What proposes draft tokens: the interface the step loop speculates with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Proposer(Protocol):
    """Proposes draft tokens for running requests; the target model verifies them.

    Contract: one caller (the engine thread). `propose` returns up to `k` tokens that
    continue `token_ids` (the request's prompt and its output so far, all accepted); an
    empty list means no draft this step. `accepted` says the sequence is now
    `num_tokens` long: the drafts past it were rejected, and state kept for them (an
    index, a draft model's KV) must be rolled back to that length. `release` forgets a
    request (finished, aborted, preempted for good); safe for an unknown id.
    """

    def propose(self, request_id: str, token_ids: Sequence[int], k: int) -> list[int]: ...

    def accepted(self, request_id: str, num_tokens: int) -> None: ...

    def release(self, request_id: str) -> None: ...
