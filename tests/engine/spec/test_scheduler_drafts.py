"""The scheduler's side of speculation: pages for the drafts, the verified run taken token
by token, and nothing of a rejected draft kept (pages, prefix cache)."""

from __future__ import annotations

from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.core.scheduler import Scheduler
from libs.common.engine.core.sequence import FinishReason, Sequence, SequenceStatus, pages_for
from tests.engine.core.test_scheduler import PAGE
from tests.engine.core.test_scheduler import make as scheduler


def make(pages: int = 16) -> Scheduler:
    return scheduler(pages, seqs=4, budget=64)


def decoding(s: Scheduler, prompt: int = 6, max_tokens: int = 32) -> Sequence:
    """A sequence past its prefill, one token sampled: the next step decodes it."""
    seq = Sequence("r", list(range(100, 100 + prompt)), SamplingParams(max_tokens=max_tokens))
    s.add(seq)
    out = s.schedule()
    s.postprocess(out, {"r": 50})
    return seq


def test_drafts_are_computed_with_the_last_token_in_pages_of_their_own():
    s = make()
    seq = decoding(s)
    seq.draft_ids = [51, 52, 53, 54]
    (item,) = s.schedule().scheduled
    assert (item.start, item.num_tokens, item.num_drafts) == (6, 5, 4)
    assert item.token_ids == [50, 51, 52, 53, 54] and item.sample
    assert len(seq.page_table) == pages_for(6 + 5, PAGE)


def test_a_rejection_keeps_only_the_accepted_positions():
    s = make()
    seq = decoding(s)
    seq.draft_ids = [51, 52, 53, 54, 55]
    out = s.schedule()
    (item,) = out.scheduled
    s.postprocess(out, {})  # a speculative item is left to take_verified
    assert seq.num_computed_tokens == 6
    for token in (51, 99):  # the first draft accepted, the target's own token after it
        assert s.take_verified(item, token)
    s.end_verified(item)
    assert seq.token_ids[6:] == [50, 51, 99] and seq.num_computed_tokens == 8
    assert seq.draft_ids == [] and len(seq.page_table) == pages_for(8, PAGE)
    # Pages committed to the prefix cache hold computed, accepted tokens only.
    assert seq.num_committed_pages == 8 // PAGE
    assert (
        s.kv.allocator.num_free
        + len(seq.page_table)
        - seq.num_committed_pages
        + len(s.kv.cache._nodes)
        == s.kv.allocator.num_pages
    )


def test_max_tokens_reached_inside_a_run_finishes_there():
    s = make()
    seq = decoding(s, max_tokens=3)
    seq.draft_ids = [51, 52, 53]
    (item,) = s.schedule().scheduled
    assert s.take_verified(item, 51) and s.take_verified(item, 52)
    assert seq.status == SequenceStatus.FINISHED and seq.finish_reason == FinishReason.LENGTH
    assert not s.take_verified(item, 53)
    assert seq.output_token_ids == [50, 51, 52]


def test_drafts_never_take_pages_the_free_list_does_not_have():
    s = make(pages=3)  # 6 prompt tokens + 1 = 2 pages; 1 free
    seq = decoding(s, max_tokens=6)
    seq.draft_ids = [51, 52, 53, 54, 55, 56]  # would need 13 tokens: 4 pages
    (item,) = s.schedule().scheduled
    assert item.num_drafts == 0 and item.num_tokens == 1 and seq.draft_ids == []
    assert s.num_running == 1  # nobody was preempted for drafts


def test_a_held_sequence_keeps_no_page_of_rejected_drafts():
    s = make()
    seq = Sequence("r", list(range(100, 106)), SamplingParams(max_tokens=32), keep_pages=True)
    s.add(seq)
    s.postprocess(s.schedule(), {"r": 50})
    seq.draft_ids = [51, 52, 53, 54, 55, 56, 57]
    (item,) = s.schedule().scheduled
    assert len(seq.page_table) == pages_for(6 + 8, PAGE)
    assert s.take_verified(item, 9)  # the first draft rejected
    s.finish("r", FinishReason.STOP)  # a stop string on that token
    assert seq.status == SequenceStatus.HELD
    assert len(seq.page_table) == pages_for(seq.num_computed_tokens, PAGE) == 2
