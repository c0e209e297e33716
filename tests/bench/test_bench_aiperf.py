"""bench.aiperf: the slice AIPerf replays is the one bench.serve replays (same lengths,
outputs, times, hash ids), and the comparison reads both tools' JSON."""

from __future__ import annotations

import json

from bench import aiperf
from bench.workloads import TraceReplay

ROWS = [
    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": list(range(14))},
    {"timestamp": 3000, "input_length": 600, "output_length": 3, "hash_ids": [0, 99]},
    {"timestamp": 4500, "input_length": 100, "output_length": 40, "hash_ids": [7]},
]


def test_the_aiperf_slice_has_bench_serves_lengths_outputs_and_times(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "aiperf.jsonl"
    argv = ["trace", "--trace", str(trace), "--num-prompts", "3", "--trace-block-len", "8",
            "--trace-time-scale", "4", "--trace-output-scale", "0.1",
            "--out", str(out)]  # fmt: skip
    assert aiperf.main(argv) == 0
    said = capsys.readouterr().out  # both tools' commands on this slice
    assert f"--custom-dataset-type mooncake_trace --input-file {out} --fixed-schedule" in said
    assert "--isl-block-size 8" in said and "--workload trace --trace" in said
    ours = TraceReplay(trace, block_len=8, output_scale=0.1, time_scale=4.0)
    theirs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["hash_ids"] for r in theirs] == [r["hash_ids"] for r in ROWS]
    assert [r["input_length"] for r in theirs] == [
        len(t.messages[0]["content"].split(" ")) for t in ours.turns
    ]
    assert [r["output_length"] for r in theirs] == [t.max_tokens for t in ours.turns]
    assert [r["timestamp"] / 1000 for r in theirs] == [t.at for t in ours.turns]


def test_a_last_block_is_never_empty_nor_past_its_block():
    # AIPerf's prompt is (ids - 1) x block + a last block of 1..block tokens.
    for length in (1, 512, 513, 1024, 1030, 5000):
        rec = aiperf.scaled({"timestamp": 0, "input_length": length, "output_length": 1,
                             "hash_ids": [1, 2]}, 8, 1.0, 1.0)  # fmt: skip
        assert 9 <= rec["input_length"] <= 16


def test_compare_puts_aiperf_itl_beside_bench_serves_tpot():
    serve = {"summary": {"request_throughput": 0.8, "output_throughput": 30.0,
                         "prompt_tokens": 500, "completion_tokens": 80, "completed": 2,
                         "ttft_ms": {"mean": 100.0, "median": 90.0, "p90": 150.0},
                         "tpot_ms": {"mean": 50.0}, "e2e_ms": {"mean": 2000.0}}}  # fmt: skip
    names = ("request_throughput", "output_token_throughput", "input_sequence_length",
             "output_sequence_length", "time_to_first_token", "inter_token_latency",
             "request_latency")  # fmt: skip
    theirs = {n: {"avg": 1.0, "p50": 2.0, "p90": 3.0} for n in names}
    rows = aiperf.figures(serve, theirs)
    assert rows["TPOT (AIPerf ITL) mean ms"] == (50.0, 1.0)
    assert rows["mean input tokens"] == (250.0, 1.0) and rows["TTFT p90 ms"] == (150.0, 3.0)


def test_the_tokenizer_lands_in_the_hf_cache_layout_and_encodes_as_the_router(tmp_path):
    from tokenizers import Tokenizer

    from libs.common.engine.load.source import load_tokenizer

    assert aiperf.main(["tokenizer", "--hf-home", str(tmp_path)]) == 0
    repo = tmp_path / "hub" / "models--tandem--smollm2-tokenizer"
    snapshot = repo / "snapshots" / (repo / "refs" / "main").read_text()
    text = "Tandem serves the default model."
    ours = load_tokenizer("default")[0].tokenizer.encode(text, add_special_tokens=False).ids
    cached = Tokenizer.from_file(str(snapshot / "tokenizer.json"))
    assert cached.encode(text, add_special_tokens=False).ids == ours
    assert json.loads((snapshot / "tokenizer_config.json").read_text())["tokenizer_class"]
