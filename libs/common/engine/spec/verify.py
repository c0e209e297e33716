"""Verification of drafts: which of the target's tokens a speculative step emits.

Each verified position is sampled as decoding without drafts would sample it there (the
same processed logits, the same seeded draw: SamplingRow.step counts the drafts before
it), and a draft is accepted while it equals the target's token. Greedy, that is the
argmax test; sampled, it is rejection sampling for a deterministic draft: the draft `t`
is kept with probability p(t) under the target's processed distribution, and on a
rejection the emitted token is the target's draw conditioned on not being `t`, that is
p with `t` removed and renormalized. Either way the emitted tokens are distributed as
(and, for a seeded request, are exactly) those of decoding without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence

from libs.common.engine.core.batch import ScheduledSeq
from libs.common.engine.core.outputs import TokenLogprobs
from libs.common.engine.model.sampler import SamplerOutput


def accepted_run(drafts: Sequence[int], tokens: Sequence[int]) -> list[int]:
    """The tokens a verified item emits: `tokens[i]` is the target's token after
    `drafts[:i]` (len(drafts) + 1 of them); the drafts equal to the target's token, then
    the target's token where they first differ (or after the last draft)."""
    if len(tokens) != len(drafts) + 1:
        raise ValueError(f"{len(tokens)} verified tokens for {len(drafts)} drafts")
    for i, draft in enumerate(drafts):
        if tokens[i] != draft:
            return list(tokens[: i + 1])
    return list(tokens)


def split_runs(
    items: list[ScheduledSeq], result: SamplerOutput
) -> list[tuple[list[int], list[TokenLogprobs | None]]]:
    """The sampler's rows per sampling item, in order: 1 + num_drafts each."""
    runs = []
    at = 0
    for item in items:
        n = 1 + item.num_drafts
        runs.append((result.token_ids[at : at + n], result.logprobs[at : at + n]))
        at += n
    if at != len(result.token_ids):
        raise ValueError(f"{len(result.token_ids)} sampled rows for {at} positions")
    return runs
