"""Sequence bookkeeping: token split, page arithmetic."""

from __future__ import annotations

import pytest

from libs.common.engine.core.sequence import Sequence, SequenceStatus, pages_for


def test_pages_for_rounds_up_to_whole_pages():
    assert [pages_for(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]


def test_output_tokens_follow_the_prompt():
    seq = Sequence("r", [1, 2, 3])
    seq.append_token(9)
    assert seq.prompt_token_ids == [1, 2, 3] and seq.output_token_ids == [9]
    assert (seq.num_tokens, seq.num_output_tokens, seq.last_token_id) == (4, 1, 9)


def test_new_pages_needed_count_only_what_the_table_lacks():
    seq = Sequence("r", list(range(10)))
    seq.page_table = [5, 6]
    assert seq.num_new_pages_for(8, 4) == 0
    assert seq.num_new_pages_for(9, 4) == 1


def test_a_new_sequence_waits_and_holds_nothing():
    seq = Sequence("r", [1])
    assert seq.status == SequenceStatus.WAITING and seq.page_table == []


def test_prefill_only_implies_keeping_pages():
    assert Sequence("r", [1], prefill_only=True).keep_pages


def test_an_empty_prompt_is_rejected():
    with pytest.raises(ValueError, match="prompt"):
        Sequence("r", [])
