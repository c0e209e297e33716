"""Drafting policy without the model: n-gram lookup, the draft length per request, and
which target tokens a verified run emits."""

from __future__ import annotations

import pytest

from libs.common.engine.config import EngineConfig
from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.core.sequence import Sequence, SequenceStatus
from libs.common.engine.model.linear import QuantLinear
from libs.common.engine.spec.ngram import NgramProposer
from libs.common.engine.spec.speculator import (
    COST_SAMPLES,
    FIRST_ACCEPTANCE,
    PROBE_ACCEPTANCE,
    ROW_COST,
    STEP_ROWS,
    Speculator,
    StepCosts,
    best_draft_length,
    make_speculator,
)
from libs.common.engine.spec.verify import accepted_run


def test_ngram_drafts_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    p = NgramProposer()
    # "7 1 2 3" occurred followed by 4 5; "2 3" also occurred followed by 9: the longer wins.
    tokens = [2, 3, 9, 7, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    assert p.propose("r", tokens, 3) == [4, 5, 6]
    tokens.append(8)  # "3 8" never occurred, "8" neither: no draft
    assert p.propose("r", tokens, 3) == []


def test_ngram_draft_past_the_end_repeats_the_period():
    assert NgramProposer().propose("r", [5, 6, 7, 5, 6, 7], 5) == [5, 6, 7, 5, 6]


def test_ngram_index_is_incremental_and_equal_to_a_fresh_one():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 3, 1]
    growing = NgramProposer()
    for n in range(2, len(tokens) + 1):
        assert growing.propose("r", tokens[:n], 4) == NgramProposer().propose("x", tokens[:n], 4)


def test_ngram_rebuilds_when_told_the_sequence_is_shorter_and_forgets_on_release():
    p = NgramProposer()
    assert p.propose("r", [1, 2, 1], 2) == [2, 1]
    p.accepted("r", 2)
    assert p.propose("r", [3, 4, 3], 2) == [4, 3]
    p.release("r")
    p.release("r")  # safe twice
    assert p.propose("r", [9, 8], 2) == []


def test_accepted_run_keeps_matching_drafts_then_the_targets_token():
    assert accepted_run([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accepted_run([5, 6], [5, 6, 8]) == [5, 6, 8]  # all accepted, plus the bonus
    assert accepted_run([5], [4, 5]) == [4]
    with pytest.raises(ValueError):
        accepted_run([5], [5])


def _running(request_id: str, tokens: list[int], max_tokens: int = 64) -> Sequence:
    seq = Sequence(request_id, tokens[:4], SamplingParams(max_tokens=max_tokens))
    seq.token_ids.extend(tokens[4:])
    seq.num_computed_tokens = seq.num_tokens - 1
    seq.status = SequenceStatus.RUNNING
    return seq


REPEATING = [1, 2, 3, 4] * 4


def test_draft_length_is_the_one_with_most_tokens_per_step_cost():
    lengths = [best_draft_length(a / 20, 8) for a in range(21)]
    assert lengths == sorted(lengths), "a draft that holds more often is never drafted shorter"
    assert lengths[0] == 0 and best_draft_length(0.2, 8) == 0  # drafts rarely hold: none
    assert best_draft_length(0.95, 3) == 3
    # Drafts that always hold: the longest that still takes the fused 4-row step (3) beats
    # 8 in the panel form ((1 + 3) / ROW_COST[3] > (1 + 8) / ROW_COST[8]).
    assert best_draft_length(1.0, 8) == 3 and best_draft_length(1.0, 2) == 2


def test_measured_step_costs_replace_the_table_once_a_length_has_enough_steps():
    costs = StepCosts()
    for _ in range(COST_SAMPLES - 1):
        costs.add(0, 0.010)
        costs.add(1, 0.0105)
    assert costs.relative() == ROW_COST  # too few steps yet
    costs.add(0, 0.010)
    costs.add(1, 0.0105)
    c = costs.relative()
    assert c[0] == 1.0 and c[1] == pytest.approx(1.05)
    # unmeasured lengths within the fused layer: linear in rows from the longest measured;
    # past it (the panel form) the table's
    assert c[3] == pytest.approx(1.15) and c[5] == ROW_COST[5]
    # a host where a draft row is this cheap drafts longer at an acceptance where the table
    # says one draft
    assert best_draft_length(0.5, 3) == 1 and best_draft_length(0.5, 3, c) == 3
    costs.add(0, 1.0)  # one step slowed by something else counts as twice the mean
    assert costs.relative()[1] > 0.85 * 1.05
    assert costs.stats()["steps"][:2] == [COST_SAMPLES + 1, COST_SAMPLES]


def test_costly_drafts_measured_on_this_host_stop_drafting():
    costs = StepCosts()
    for _ in range(COST_SAMPLES):
        costs.add(0, 0.010)
        costs.add(1, 0.030)  # a verification row as dear as two whole steps
    assert costs.relative()[3] == pytest.approx(7.0)
    assert best_draft_length(0.75, 3) > 0 and best_draft_length(0.75, 3, costs.relative()) == 0


def test_draft_length_grows_with_acceptance_and_never_passes_max_tokens():
    spec = Speculator(NgramProposer(), max_draft=3)
    seq = _running("r", REPEATING)
    spec.draft([seq])
    assert len(seq.draft_ids) == best_draft_length(FIRST_ACCEPTANCE, 3) >= 1
    spec.verified(seq, len(seq.draft_ids), 0)  # the first draft did not hold
    spec.draft([seq])
    shorter = len(seq.draft_ids)
    for _ in range(4):
        spec.verified(seq, len(seq.draft_ids), len(seq.draft_ids))
        spec.draft([seq])
    assert len(seq.draft_ids) == 3 > shorter
    near_end = _running("e", REPEATING, max_tokens=len(REPEATING) - 4 + 2)
    for _ in range(4):
        spec.draft([near_end])
        spec.verified(near_end, len(near_end.draft_ids), len(near_end.draft_ids))
    spec.draft([near_end])
    assert len(near_end.draft_ids) == 1  # 2 tokens left: 1 draft and the target's one


def test_low_acceptance_pauses_drafting_then_probes_one_draft():
    spec = Speculator(NgramProposer(), max_draft=3)
    seq = _running("r", REPEATING)
    paused_after = None
    for step in range(10):
        spec.draft([seq])
        if not seq.draft_ids:
            paused_after = step
            break
        spec.verified(seq, len(seq.draft_ids), 0)
    assert paused_after is not None, "rejected drafts must pause drafting"
    pause = 0
    while not seq.draft_ids:
        pause += 1
        spec.draft([seq])
    # the step that paused, 4 more, then a probe
    assert pause == 5 and len(seq.draft_ids) == best_draft_length(PROBE_ACCEPTANCE, 3) > 0


def test_two_streams_draft_one_token_each_and_three_draft_none():
    spec = make_speculator(EngineConfig(speculation="ngram"))
    assert spec is not None and spec.step_rows == STEP_ROWS == QuantLinear.GEMV_ROWS
    seqs = [_running(str(i), REPEATING) for i in range(3)]
    spec.draft(seqs[:1])  # alone: as long as the policy likes, up to max_draft
    assert len(seqs[0].draft_ids) == best_draft_length(FIRST_ACCEPTANCE, 3) > 1
    spec.draft(seqs[:2])  # two: the step's rows shared, one draft each
    assert [len(s.draft_ids) for s in seqs[:2]] == [1, 1]
    spec.draft(seqs)  # three: none (a draft each would pass the fused layer's rows)
    assert all(not s.draft_ids for s in seqs)
    lone = Speculator(NgramProposer(), max_draft=3, max_streams=1)
    lone.draft(seqs[:2])
    assert all(not s.draft_ids for s in seqs[:2])


def test_a_sequence_with_a_prefill_chunk_left_gets_no_draft():
    spec = Speculator(NgramProposer(), max_draft=8)
    seq = _running("r", REPEATING)
    seq.num_computed_tokens -= 2
    spec.draft([seq])
    assert seq.draft_ids == []
