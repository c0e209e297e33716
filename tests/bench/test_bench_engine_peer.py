"""bench.engine's llama.cpp peer: llama-bench's JSON, the ratios and verdicts, the build's
options, and the path where the peer is not built. The tests that run the real binaries
skip, with the reason shown, where `make bench-peers` has not built them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import engine, peer_llama_cpp
from bench.deployments import PeerServer
from libs.common.engine.load.source import default_model_path
from scripts import build_llama_cpp

# Real output of the build's `llama-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -p 512,2048
# -n 128 -t 2 -r 3 -o json` (on a busy 2-core host: not a figure to quote), trimmed to the
# fields the parser reads and a few beside them.
LLAMA_BENCH_JSON = """\
[
 {
  "cpu_info": "AMD EPYC",
  "model_type": "llama 256M Q4_1",
  "n_threads": 2,
  "type_k": "f16",
  "n_prompt": 512,
  "n_gen": 0,
  "n_depth": 0,
  "avg_ns": 5211961774,
  "stddev_ns": 20005214,
  "avg_ts": 98.236528,
  "stddev_ts": 0.377062,
  "samples_ts": [98.6141, 98.2355, 97.86]
 },
 {
  "cpu_info": "AMD EPYC",
  "model_type": "llama 256M Q4_1",
  "n_threads": 2,
  "type_k": "f16",
  "n_prompt": 2048,
  "n_gen": 0,
  "n_depth": 0,
  "avg_ns": 19608038692,
  "stddev_ns": 3812078467,
  "avg_ts": 105.457047,
  "stddev_ts": 12.914202,
  "samples_ts": [101.902, 94.6926, 119.776]
 },
 {
  "cpu_info": "AMD EPYC",
  "model_type": "llama 256M Q4_1",
  "n_threads": 2,
  "type_k": "f16",
  "n_prompt": 0,
  "n_gen": 128,
  "n_depth": 0,
  "avg_ns": 1016202693,
  "stddev_ns": 27184666,
  "avg_ts": 126.0192,
  "stddev_ts": 3.369054,
  "samples_ts": [126.042, 129.377, 122.639]
 }
]
"""

AVX2_EPYC = "flags\t\t: fpu sse4_2 avx f16c fma bmi2 avx2\n"
AMX_XEON = (
    "flags\t\t: fpu sse4_2 avx f16c fma bmi2 avx2 avx512f avx512cd avx512vl avx512dq "
    "avx512bw avx512_vnni avx512_bf16 avx512vbmi amx_tile amx_int8 amx_bf16\n"
)


def options(cpuinfo: str) -> dict[str, str]:
    flags = build_llama_cpp.cpu_flags(cpuinfo)
    pairs = (
        o.removeprefix("-D").split("=") for o in build_llama_cpp.cmake_options(flags, "x86_64")
    )
    return dict(pairs)


def test_llama_bench_json_becomes_one_entry_per_test_named_pp_or_tg():
    out = peer_llama_cpp.parse_llama_bench(LLAMA_BENCH_JSON)
    assert set(out) == {"pp512", "pp2048", "tg128"}
    assert out["pp512"] == {"tok_s": 98.24, "stddev_tok_s": 0.38, "threads": 2,
                            "type": "llama 256M Q4_1"}  # fmt: skip
    assert out["pp2048"]["tok_s"] == 105.46 and out["tg128"]["tok_s"] == 126.02


def test_a_combined_prompt_and_generation_test_keeps_both_in_its_name():
    run = {"n_prompt": 16, "n_gen": 4, "avg_ts": 10.0, "stddev_ts": 0.5, "n_threads": 1}
    assert list(peer_llama_cpp.parse_llama_bench(json.dumps([run]))) == ["pp16+tg4"]


def test_ratios_are_ours_over_llama_cpp_with_one_verdict_per_goal():
    peer = {"llama_bench": {"tg128": {"tok_s": 100.0}, "pp2048": {"tok_s": 400.0}},
            "llama_server": {"tok_s": 200.0}}  # fmt: skip
    out = peer_llama_cpp.ratios(100.0, 700.0, 450.0, peer, tg="tg128", pp="pp2048",
                                streams="streams_32")  # fmt: skip
    assert out["ratios"] == {"single_stream_vs_tg128": 1.0, "prefill_vs_pp2048": 1.75,
                             "streams_32_vs_llama_server": 2.25}  # fmt: skip
    assert out["verdicts"] == {"single_stream_vs_tg128_1.0x": True,
                               "prefill_vs_pp2048_2.0x": False,
                               "streams_32_vs_llama_server_2.0x": True}  # fmt: skip


def test_a_figure_the_peer_lacks_leaves_its_ratio_none_and_no_verdict():
    peer = {"llama_bench": {"tg128": {"tok_s": 50.0}}, "llama_server_error": "TimeoutError"}
    out = peer_llama_cpp.ratios(25.0, 700.0, 450.0, peer, tg="tg128", pp="pp2048",
                                streams="streams_32")  # fmt: skip
    assert out["ratios"]["prefill_vs_pp2048"] is None
    assert out["ratios"]["streams_32_vs_llama_server"] is None
    assert out["verdicts"] == {"single_stream_vs_tg128_1.0x": False}


def test_an_unbuilt_peer_is_reported_absent_with_the_make_target(tmp_path):
    args = argparse.Namespace(peer_llama_cpp=str(tmp_path), threads=2, prefill_tokens=2048,
                              new_tokens=128, streams=32, prompt_tokens=128)  # fmt: skip
    section = engine.llama_cpp_section(args, Path("model.gguf"), 1000, report={})
    assert section == {"absent": f"not built: no llama-bench, llama-server in "
                                 f"{tmp_path / 'bin'} (make bench-peers)"}  # fmt: skip


def test_a_model_that_is_no_gguf_is_reported_absent(tmp_path):
    (tmp_path / "bin").mkdir()
    for name in peer_llama_cpp.BINARIES:
        (tmp_path / "bin" / name).write_text("")
    section = peer_llama_cpp.measure(
        tmp_path, tmp_path / "hf-folder", 1, prefill_tokens=16, new_tokens=2,
        stream_prompts=[[1]], workdir=tmp_path)  # fmt: skip
    assert section["absent"].startswith("llama.cpp reads GGUF files")


def test_none_disables_the_peer():
    assert peer_llama_cpp.missing(None).startswith("disabled")


def test_llama_server_peer_without_its_binary_names_the_make_target(tmp_path):
    server = PeerServer("llama-server", str(tmp_path / "llama-server"), tmp_path, tmp_path, 1)
    assert "make bench-peers" in server.available()


def test_the_build_keeps_amx_off_and_native_off_even_where_the_cpu_reports_amx():
    opts = options(AMX_XEON)
    assert opts["GGML_NATIVE"] == "OFF"
    assert opts["GGML_AMX_TILE"] == opts["GGML_AMX_INT8"] == opts["GGML_AMX_BF16"] == "OFF"
    assert opts["GGML_AVX512"] == opts["GGML_AVX512_VNNI"] == opts["GGML_AVX512_BF16"] == "ON"


def test_an_avx2_only_cpu_gets_no_avx512():
    opts = options(AVX2_EPYC)
    assert opts["GGML_AVX2"] == opts["GGML_FMA"] == opts["GGML_F16C"] == "ON"
    assert opts["GGML_AVX512"] == opts["GGML_AVX512_VNNI"] == "OFF"


def test_the_avx2_isa_on_an_avx512_host_names_x86_64_v3_alone():
    flags = build_llama_cpp.cpu_flags(AMX_XEON)
    pairs = (o.removeprefix("-D").split("=")
             for o in build_llama_cpp.cmake_options(flags, "x86_64", "avx2"))  # fmt: skip
    opts = dict(pairs)
    assert opts == {**options(AVX2_EPYC), "GGML_AVX_VNNI": "OFF"}  # what the EPYC gets
    assert opts["GGML_AVX2"] == opts["GGML_FMA"] == opts["GGML_F16C"] == "ON"
    assert "ON" not in {v for k, v in opts.items() if "AVX512" in k or "AMX" in k}
    assert opts["GGML_NATIVE"] == "OFF"


def test_an_isa_level_is_refused_off_x86_and_an_unknown_one_anywhere():
    with pytest.raises(ValueError, match="x86"):
        build_llama_cpp.cmake_options({"neon"}, "aarch64", "avx2")
    with pytest.raises(ValueError, match="--isa"):
        build_llama_cpp.cmake_options(set(), "x86_64", "avx10")


def test_an_avx512_instruction_fails_the_avx2_build_only():
    # objdump -d --no-show-raw-insn lines: address, tab, instruction.
    text = (
        "  4a0:\tvpaddd %ymm1,%ymm2,%ymm3\n"
        "  4a4:\tvpdpbusd %zmm1,%zmm2,%zmm3\n"
        "  4aa:\tvmovdqu8 %ymm1,(%rax){%k1}\n"
        "  4b0:\tvpaddd %ymm17,%ymm2,%ymm3\n"
        "  4b6:\tldtilecfg (%rax)\n"
    )
    found = build_llama_cpp.forbidden_in_disassembly(text, "avx2")
    assert found == ["vpdpbusd %zmm1,%zmm2,%zmm3", "vmovdqu8 %ymm1,(%rax){%k1}",
                     "vpaddd %ymm17,%ymm2,%ymm3", "ldtilecfg (%rax)"]  # fmt: skip
    assert build_llama_cpp.forbidden_in_disassembly(text, "native") == ["ldtilecfg (%rax)"]


def test_a_build_with_other_options_is_not_up_to_date(tmp_path):
    (tmp_path / "bin").mkdir()
    for name in build_llama_cpp.BINARIES:
        (tmp_path / "bin" / name).write_text("")
    opts = build_llama_cpp.cmake_options(build_llama_cpp.cpu_flags(AVX2_EPYC), "x86_64")
    stamp = {"version": build_llama_cpp.VERSION, "cmake_options": opts}
    (tmp_path / "build.json").write_text(json.dumps(stamp))
    assert build_llama_cpp.up_to_date(tmp_path, opts)
    other = build_llama_cpp.cmake_options(build_llama_cpp.cpu_flags(AMX_XEON), "x86_64")
    assert not build_llama_cpp.up_to_date(tmp_path, other)


def built() -> Path:
    why = peer_llama_cpp.missing(peer_llama_cpp.DEFAULT_DIR)
    if why:
        pytest.skip(f"llama.cpp peer {why}")
    if not Path(default_model_path()).exists():
        pytest.skip(f"no default GGUF at {default_model_path()}")
    return peer_llama_cpp.DEFAULT_DIR


def test_the_built_llama_bench_runs_the_default_gguf():
    folder = built()
    out = peer_llama_cpp.run_llama_bench(folder, Path(default_model_path()), 1, [16], 2,
                                         repetitions=1, timeout=60)  # fmt: skip
    assert set(out) == {"pp16", "tg2"} and all(e["tok_s"] > 0 for e in out.values())


def test_the_built_llama_server_generates_every_token_asked_for_with_eos_ignored(tmp_path):
    folder = built()
    prompts = [[100 + i, 200 + i, 300 + i, 400 + i] for i in range(2)]
    out = peer_llama_cpp.run_llama_server(folder, Path(default_model_path()), 1, prompts, 8,
                                          tmp_path, timeout=60)  # fmt: skip
    assert out["output_tokens"] == 2 * 8 and out["parallel"] == 2
