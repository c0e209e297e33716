"""bench.engine --speculation with tiny settings on the default model: both engines run
every case, their greedy tokens are compared, the figures and the goals are reported."""

from __future__ import annotations

import orjson
import pytest

from bench import engine, engine_spec


@pytest.mark.slow
def test_speculation_off_and_on_make_the_same_tokens_and_every_figure_is_reported(capsys):
    argv = ["--speculation", "--json", "--threads", "1", "--tasks", "1", "--streams", "2",
            "--new-tokens", "16"]  # fmt: skip
    assert engine.main(argv) == 0
    report = orjson.loads(capsys.readouterr().out)
    cases = ("one_stream", "one_stream_json_schema", "streams_2")
    assert set(report) == {"machine", "config", *cases, "verdicts", "step_costs"}
    costs = report["step_costs"]  # the policy's measured costs by draft length
    assert costs["relative"][0] == 1.0 and sum(costs["steps"]) > 0
    for case in cases:
        entry = report[case]
        assert entry["identical"] and entry["mismatches"] == [], case
        off, on = entry["off"], entry["on"]
        assert off["output_tokens"] == on["output_tokens"] > 0, case
        assert off["decode_tok_s"] > 0 and on["decode_tok_s"] > 0 and entry["ratio"] > 0
        rounds = entry["round_ratios"]  # one a round, around the whole run's ratio
        assert len(rounds) == report["config"]["rounds"] and min(rounds) > 0, case
    one = report["one_stream"]
    assert one["drafts_proposed"] >= one["drafts_accepted"] > 0  # grounded answers quote
    assert 0 < one["acceptance"] <= 1
    assert report["verdicts"]["greedy_identical"] is True
    assert set(report["verdicts"]) == {"greedy_identical", "one_stream_1.8x",
                                       "one_stream_json_schema_1.5x", "streams_2_1.0x"}  # fmt: skip


def test_the_first_difference_of_two_token_lists():
    assert engine_spec.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert engine_spec.first_difference([1, 2], [1, 2, 3]) == 2


@pytest.mark.parametrize("argv, flag", [(["--tasks", "0"], "--tasks"),
                                        (["--rounds", "0"], "--rounds"),
                                        (["--streams", "0"], "--streams")])  # fmt: skip
def test_bad_speculation_flags_are_refused_before_the_model_loads(argv, flag, capsys):
    with pytest.raises(SystemExit) as info:
        engine.main(["--speculation", *argv])
    assert info.value.code == 2
    assert flag in capsys.readouterr().err
