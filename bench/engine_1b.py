"""bench.engine --model synthetic-1b: one stream on a ~1B-parameter Q4_K Llama.

    python -m bench.engine --model synthetic-1b --json [--kernels avx2 --peer-llama-cpp DIR]

The model is bench/synthetic_model.py's (Llama 3.2 1B's shapes, random Q4_K blocks, the
tied embedding Q6_K), written once into the bench's cache (about a minute) and given to
both engines. On the 135M default model per-step Python overhead hides the kernels; here a
decode step reads ~630 MB of weights, so the figures say how close the kernels come to the
machine's memory bandwidth. In one run, with the same threads:
- ours: a 128-token prompt (--prompt-tokens), 128 greedy tokens (--new-tokens), EOS
  ignored, three times after a warm-up; decode tok/s = tokens after the first over the time
  after the first, their mean (llama-bench reports its mean too);
- memory (MiB): the process's RSS before the load, after the runs and at its peak;
- the read-bandwidth bound: measure_read_bandwidth / weight bytes a decode step reads (the
  same bytes for both engines: the file's blocks);
- llama.cpp: `llama-bench -p 512 -n 128 -r 3` (tg128, and pp512) on the same file;
- prefill: ours, a 512-token prompt (PREFILL_TOKENS, one chunk) to its first token, three
  times, tok/s = 512 / that time (their mean), against llama-bench's pp512 (no goal:
  K-quant prompts were slow, docs/engine.md "Weights in memory").
Verdicts: issue 40's goals, ours >= 1.0x tg128 and >= 50% of the read-bandwidth bound.
About 5 minutes on 2 threads (plus ~30 s for the file's first write).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import orjson

from bench import peer_llama_cpp, synthetic_model
from bench.engine_measure import (
    measure_copy_bandwidth,
    measure_read_bandwidth,
    run_ours,
    token_prompts,
)

MODEL_NAME = "synthetic-1b"
RUNS = 3
PREFILL_TOKENS = 512  # the prompt of the prefill figure, against llama-bench's pp512
# Issue 40's goals on this model.
GOALS = {"single_stream_vs_tg": 1.0, "fraction_of_read_bandwidth_bound": 0.5}


def memory_mb() -> dict[str, float]:
    """This process's resident set now and at its peak (Linux's /proc/self/status)."""
    out = {}
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = round(int(value.split()[0]) / 1024, 1)
    return {"rss_mb": out.get("VmRSS", 0.0), "peak_rss_mb": out.get("VmHWM", 0.0)}


def single_stream(core, vocab: int, args) -> dict:
    from libs.common.engine.core.sampling_params import SamplingParams

    prompt = token_prompts(1, args.prompt_tokens, vocab)
    run_ours(core, prompt, 4, SamplingParams)  # warm-up: the kernels' first use
    runs = [run_ours(core, prompt, args.new_tokens, SamplingParams) for _ in range(RUNS)]
    rates = [r["decode_tok_s"] for r in runs]
    long_prompt = token_prompts(1, PREFILL_TOKENS, vocab)
    prefills = [PREFILL_TOKENS / run_ours(core, long_prompt, 1, SamplingParams)["seconds"]
                for _ in range(RUNS)]  # fmt: skip
    return {"decode_tok_s": round(sum(rates) / len(rates), 2),
            "decode_tok_s_runs": rates, "runs": runs,
            "prefill_tok_s": round(sum(prefills) / len(prefills), 2),
            "prefill_tok_s_runs": [round(r, 2) for r in prefills]}  # fmt: skip


def peer_section(folder: pathlib.Path | None, model: pathlib.Path, args) -> dict:
    """llama-bench tgN on the same file, or {"absent": why}."""
    why = peer_llama_cpp.missing(folder, ("llama-bench",))  # llama-server is not used here
    if why or folder is None:
        return {"absent": why}
    section: dict = {"dir": str(folder), "threads": args.threads,
                     "build": peer_llama_cpp.build_info(folder)}  # fmt: skip
    print("llama.cpp ...", file=sys.stderr)
    try:
        section["llama_bench"] = peer_llama_cpp.run_llama_bench(
            folder, model, args.threads, [PREFILL_TOKENS], args.new_tokens, repetitions=RUNS
        )
    except (RuntimeError, OSError, ValueError, KeyError, subprocess.TimeoutExpired) as e:
        section["llama_bench_error"] = str(e)
    return section


def verdicts(ours: float, bound: float, peer: dict, tg: str, prefill: float = 0.0) -> dict:
    """The ratios and one verdict per goal; without the peer's figure its goal has none."""
    fraction = round(ours / bound, 3)
    pp = peer.get("llama_bench", {}).get(f"pp{PREFILL_TOKENS}", {}).get("tok_s")
    out: dict = {"ratios": {"fraction_of_read_bandwidth_bound": fraction}, "verdicts": {
        f"single_stream_{GOALS['fraction_of_read_bandwidth_bound']:.0%}_read_bandwidth_bound":
            fraction >= GOALS["fraction_of_read_bandwidth_bound"]}}  # fmt: skip
    theirs = peer.get("llama_bench", {}).get(tg, {}).get("tok_s")
    if theirs:
        ratio = round(ours / theirs, 3)
        goal = GOALS["single_stream_vs_tg"]
        out["ratios"][f"single_stream_vs_{tg}"] = ratio
        out["ratios"]["llama_cpp_fraction_of_read_bandwidth_bound"] = round(theirs / bound, 3)
        out["verdicts"][f"single_stream_vs_{tg}_{goal}x"] = ratio >= goal
    if pp and prefill:
        out["ratios"][f"prefill_vs_pp{PREFILL_TOKENS}"] = round(prefill / pp, 3)
    return out


def run(args, report: dict) -> dict:
    """Fill `report` (its machine section already there) for the synthetic model."""
    import torch

    from libs.common.engine.config import EngineConfig
    from libs.common.engine.step_loop import EngineCore

    spec = synthetic_model.SyntheticLlama()
    report["machine"]["weights"] = "native"  # the file's blocks, as llama.cpp reads them
    print(f"{MODEL_NAME}: the GGUF (written once into {synthetic_model.cache_dir()}) ...",
          file=sys.stderr)  # fmt: skip
    start = time.perf_counter()
    path = synthetic_model.ensure(spec)
    made_s = time.perf_counter() - start
    before = memory_mb()
    print(f"{MODEL_NAME}: ours ...", file=sys.stderr)
    tokens = max(args.prompt_tokens + args.new_tokens, PREFILL_TOKENS + 1)
    kv_mb = max(64, tokens * 65 // 1024 + 16)  # 64 KiB a token
    core = EngineCore(EngineConfig(model=str(path), num_threads=args.threads, weights="native",
                                   max_num_batched_tokens=max(PREFILL_TOKENS, args.prompt_tokens),
                                   max_num_seqs=1, kv_cache_mb=kv_mb,
                                   enable_prefix_cache=False))  # fmt: skip
    cfg = core.model.config
    weight_bytes = core.model.weight_bytes_per_token()
    ours = single_stream(core, cfg.vocab_size, args)
    after = memory_mb()
    report["model"] = {"name": MODEL_NAME, "path": str(path), "params": cfg.num_params,
                       "file_mb": round(path.stat().st_size / 1e6, 1),
                       "weight_mb_per_token": round(weight_bytes / 1e6, 1),
                       "file_ready_s": round(made_s, 1),
                       "shape": {"hidden": spec.hidden, "layers": spec.layers, "ffn": spec.ffn,
                                 "heads": spec.heads, "kv_heads": spec.kv_heads,
                                 "vocab": cfg.vocab_size, "matrices": "Q4_K",
                                 "embedding": spec.embed_type}}  # fmt: skip
    # The peak holds the file's pages too while the loader copies the blocks out of its map.
    report["memory"] = {"rss_before_engine_mb": before["rss_mb"], **after,
                        "engine_mb": round(after["rss_mb"] - before["rss_mb"], 1),
                        "engine_peak_mb": round(after["peak_rss_mb"] - before["rss_mb"], 1),
                        "kv_cache_mb": kv_mb}  # fmt: skip
    print("measuring bounds ...", file=sys.stderr)
    read_bw, copy_bw = measure_read_bandwidth(torch), measure_copy_bandwidth(torch)
    bound = read_bw / weight_bytes
    report["bounds"] = {"read_bandwidth_gb_s": round(read_bw / 1e9, 2),
                        "copy_bandwidth_gb_s": round(copy_bw / 1e9, 2),
                        "single_stream_read_bound_tok_s": round(bound, 2),
                        "single_stream_bound_tok_s": round(copy_bw / weight_bytes, 2)}  # fmt: skip
    report["single_stream"] = {"ours": ours}
    print(f"{MODEL_NAME}: {orjson.dumps(report['single_stream']).decode()}", file=sys.stderr)
    folder = None if args.peer_llama_cpp == "none" else pathlib.Path(args.peer_llama_cpp)
    report["llama_cpp"] = peer_section(folder, path, args)
    report.update(verdicts(ours["decode_tok_s"], bound, report["llama_cpp"],
                           f"tg{args.new_tokens}", ours["prefill_tok_s"]))  # fmt: skip
    report["machine"]["loadavg_end"] = os.getloadavg()
    return report
