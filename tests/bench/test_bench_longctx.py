"""bench.longctx's pure parts: the long prompt, the decode rate, the ratios and the verdict,
the systems' flags (no process is started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import longctx
from bench.client import RequestResult


@pytest.fixture(scope="module")
def count():
    from libs.common.engine.load.source import load_tokenizer

    tokenizer = load_tokenizer("default")[0]
    return lambda text: len(tokenizer.encode(text))


def test_the_default_prompt_has_at_least_5500_tokens_of_the_default_model(count) -> None:
    prompt = longctx.build_prompt("1", 5500, count)
    assert 5500 <= count(prompt) < 5700
    assert len(set(prompt.split("."))) > 200  # varied sentences, not one line repeated


def test_prompts_of_different_tags_differ_from_the_first_line_and_share_the_rest(count) -> None:
    one, two = (longctx.build_prompt(tag, 600, count) for tag in ("1", "2"))
    assert count(one) >= 600 and one != two
    assert one.splitlines()[0] != two.splitlines()[0]
    assert one.splitlines()[1:] == two.splitlines()[1:]
    assert longctx.build_prompt("1", 600, count) == one  # deterministic


def test_decode_rate_counts_the_tokens_after_the_first_over_their_span() -> None:
    assert longctx.decode_rate(65, 2.0, 4.0) == pytest.approx(32.0)
    assert longctx.decode_rate(1, 2.0, 2.0) is None
    assert longctx.decode_rate(5, 2.0, 2.0) is None


def test_request_figures_time_decode_from_the_first_to_the_last_chunk() -> None:
    res = RequestResult(1, 0, 0, ttft=3.0, itl=[0.1] * 9, completion_tokens=10, ok=True)
    figures = longctx.request_figures(res)
    assert figures["decode_tok_s"] == pytest.approx(10.0)
    assert figures["chunks"] == 10 and figures["tokens"] == 10 and figures["ttft_s"] == 3.0
    failed = RequestResult(2, 0, 0, error="HTTP 400", completion_tokens=0)
    assert longctx.request_figures(failed)["decode_tok_s"] is None


def test_ratios_are_ours_over_theirs_for_decode_and_theirs_over_ours_for_ttft() -> None:
    ours = {"median": {"ttft_s": 10.0, "decode_tok_s": 30.0}}
    theirs = {"median": {"ttft_s": 25.0, "decode_tok_s": 25.0}}
    out = longctx.compare(ours, theirs)
    assert out["ratios"] == {"decode": 1.2, "ttft_speedup": 2.5}
    assert out["verdicts"]["decode_at_least_1.0x_llama_server"] is True
    slower = longctx.compare({"median": {"ttft_s": 1.0, "decode_tok_s": 20.0}}, theirs)
    assert slower["verdicts"]["decode_at_least_1.0x_llama_server"] is False


def test_no_verdict_when_llama_server_is_absent() -> None:
    out = longctx.compare({"median": {"ttft_s": 1.0, "decode_tok_s": 20.0}}, {"absent": "x"})
    assert out["ratios"] == {"decode": None, "ttft_speedup": None}
    assert out["verdicts"]["decode_at_least_1.0x_llama_server"] is None


def test_medians_skip_failed_requests() -> None:
    rows = [{"ok": True, "ttft_s": 1.0, "decode_tok_s": 10.0},
            {"ok": True, "ttft_s": 3.0, "decode_tok_s": 30.0},
            {"ok": False, "ttft_s": 0.0, "decode_tok_s": None}]  # fmt: skip
    assert longctx.medians(rows) == {"ttft_s": 2.0, "decode_tok_s": 20.0}


def test_both_systems_get_the_same_threads_and_ours_the_kv_dtype(tmp_path: Path) -> None:
    a = longctx.parser().parse_args(["--threads", "3", "--kv-dtype", "bf16"])
    topo = longctx.tandem(a, tmp_path).topo
    assert (topo.prefill, topo.decode, topo.pool) == (1, 1, False)
    flags = topo.worker_args
    assert flags[flags.index("--num-threads") + 1] == "3"
    assert flags[flags.index("--kv-dtype") + 1] == "bf16" and "--no-prefix-cache" in flags
    peer = longctx.llama_server(a, tmp_path, tmp_path / "m.gguf")
    assert peer.threads == 3 and peer.ctx >= a.prompt_tokens + a.max_tokens


@pytest.mark.parametrize("argv", [["--requests", "0"], ["--max-tokens", "1"], ["--threads", "0"]])
def test_bad_flags_are_refused_before_anything_starts(argv: list[str]) -> None:
    assert longctx.main(argv) == 2
