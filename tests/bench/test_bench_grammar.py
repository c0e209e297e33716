"""bench.grammar with tiny settings on the default model: both modes generate the same
number of tokens and are measured, compile times are reported, bad flags are refused."""

from __future__ import annotations

import orjson
import pytest

from bench import grammar


@pytest.mark.slow
def test_both_modes_make_the_same_tokens_and_every_figure_is_reported(capsys) -> None:
    argv = ["--json", "--threads", "1", "--streams", "1,2", "--prompt-tokens", "16",
            "--new-tokens", "4", "--rounds", "2", "--compile-iters", "1"]  # fmt: skip
    assert grammar.main(argv) == 0
    report = orjson.loads(capsys.readouterr().out)
    assert set(report) == {"machine", "config", "streams_1", "streams_2", "compile", "verdicts"}
    for n in (1, 2):
        entry = report[f"streams_{n}"]
        assert entry["same_token_counts"] and entry["ratio"] > 0
        assert entry["slowdown"] == pytest.approx(1 - entry["ratio"], abs=1e-3)
        for mode in ("unconstrained", "constrained"):
            figures = entry[mode]
            assert figures["output_tokens"] == 4 * n and figures["decode_tokens"] == 3 * n
            assert figures["tok_s"] > 0 and len(figures["tok_s_rounds"]) == 2
        assert entry["constrained"]["stream_0_text"].startswith('[{"')  # the schema held
    compile_ = report["compile"]
    assert compile_["cold_compile_ms"] > compile_["cache_hit_check_ms"] > 0
    for key in ("compiler_setup_ms", "first_compile_ms", "cold_first_mask_ms",
                "cache_hit_matcher_ms"):  # fmt: skip
        assert compile_[key] > 0, key
    assert set(report["verdicts"]) == {"streams_2_at_most_10pct_slower"}


@pytest.mark.parametrize(
    "argv, flag",
    [(["--streams", "0"], "--streams"), (["--streams", "1,x"], "--streams"),
     (["--rounds", "0"], "--rounds"), (["--new-tokens", "2"], "--new-tokens")],
)  # fmt: skip
def test_bad_flags_are_refused_before_the_model_loads(argv, flag, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        grammar.main(argv)
    assert info.value.code == 2
    assert flag in capsys.readouterr().err
