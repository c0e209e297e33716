"""Engine benchmark: our engine and transformers' generate on the same model, side by side.

    python -m bench.engine --json

Runs, in one process and one run (fp32, the same thread count for both):
- the machine's bounds: copy bandwidth (bytes of a large fp32 tensor copied
  per second) and the fp32 matmul rate (a 2048^3 product);
- one stream: 128-token prompt, 128 new tokens (greedy, EOS ignored);
- 32 streams of the same shape, all submitted at once (transformers: one
  batched generate call);
- a 2,048-token prefill (transformers: one forward keeping only the last logits).
and prints each figure, the ratio ours/transformers and the fraction of the bound.
Single-stream bound = copy bandwidth / bytes of weights read per token (in the form the
engine holds them, --weights: native by default);
32-stream bound = matmul rate / (2 FLOP x weights) per generated token, where
the matmul rate is the faster of torch.matmul and the engine's own oneDNN
product on 2048^3 (a bound the engine beats is no bound). The 32-stream
workload also gets an end-to-end bound: every prompt and generated token
costs 2 FLOP per weight, at the matmul rate, or with the prompts at the
prefill rate measured in this run; `3x transformers / bound` above 1 says
that goal cannot be met on this machine. `verdicts` holds one entry per goal.

Then llama.cpp, in the same run with the same threads (bench/peer_llama_cpp.py): llama-bench
pp512, pp<prefill> and tg<new> on the same GGUF, and llama-server with --parallel <streams>
on the same token-id prompts. The `llama_cpp` section holds its figures, the ratios
ours/llama.cpp (one stream: our decode tok/s after the first token vs tg; prefill: our
prefill tok/s vs pp; streams: our output tok/s vs llama-server's) and a verdict per goal
of issue 24. It says `absent` with the reason when the peer is not built (`make bench-peers`).

`--model synthetic-1b` runs the ~1B-parameter Q4_K model instead (bench/engine_1b.py: one
stream, ours against llama-bench tg128 and the read-bandwidth bound). `--kernels VARIANT`
forces our quantized kernels' build (TANDEM_KERNELS: avx2 on an AVX-512 host, say), with
`--peer-llama-cpp .peers/llama.cpp-avx2` the llama.cpp built for the same instruction set
(`make bench-peer-llama-cpp-avx2`); `machine.kernels` says which build ran.

`--speculation` runs instead speculative decoding off against on, on an input-grounded
workload (bench/engine_spec.py, bench/grounded.py: `--tasks`, `--rounds`, `--seed`,
`--speculation-on`, with `--streams`, `--new-tokens` and `--threads` as above).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
import tempfile
import time

import orjson
import structlog

from bench import engine_1b, engine_spec, peer_llama_cpp
from bench.engine_measure import (
    KERNEL_VARIANTS,
    kernels_used,
    measure_copy_bandwidth,
    measure_matmul_rate,
    measure_onednn_rate,
    measure_read_bandwidth,
    run_ours,
    token_prompts,
)
from bench.report import emit

log = structlog.get_logger(__name__)


def end_to_end_bound(entry: dict, prompt_tokens: int, flop_per_token: float,
                     matmul: float, prefill_tok_s: float) -> dict:  # fmt: skip
    """Output tok/s of the streams workload if every FLOP ran at the measured rates."""
    generated = entry["ours"]["output_tokens"]
    decode_s = generated * flop_per_token / matmul
    all_matmul = generated / ((prompt_tokens + generated) * flop_per_token / matmul)
    with_prefill = generated / (prompt_tokens / prefill_tok_s + decode_s)
    bound = max(all_matmul, with_prefill)
    return {
        "end_to_end_bound_tok_s": round(bound, 1),
        "end_to_end_bound_all_at_matmul_rate_tok_s": round(all_matmul, 1),
        "end_to_end_bound_prefill_at_measured_rate_tok_s": round(with_prefill, 1),
        "end_to_end_fraction_of_bound": round(entry["ours"]["tok_s"] / bound, 3),
        "three_x_transformers_over_bound": round(3 * entry["transformers"]["tok_s"] / bound, 2),
    }


def verdicts(report: dict, streams: str, prefill: str) -> dict:
    one, many, pre = report["single_stream"], report[streams], report[prefill]
    reach = many["three_x_transformers_over_bound"]
    return {
        "single_stream_1.2x_transformers": one["ratio"] >= 1.2,
        "single_stream_70pct_bandwidth_bound": one["fraction_of_bandwidth_bound"] >= 0.7,
        f"{streams}_3x_transformers": many["ratio"] >= 3.0,
        f"{streams}_3x_transformers_reachable": reach <= 1.0,
        f"{streams}_50pct_compute_bound": many["fraction_of_compute_bound"] >= 0.5,
        f"{streams}_50pct_compute_bound_decode_phase":
            many["decode_fraction_of_compute_bound"] >= 0.5,
        f"{prefill}_no_slower": pre["speedup"] >= 1.0,
    }  # fmt: skip


def run_reference(torch, model, prompts, new_tokens) -> dict:
    ids = torch.tensor(prompts)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=2, attention_mask=torch.ones_like(ids))  # fmt: skip
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        end = time.perf_counter()
    produced = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"output_tokens": produced, "seconds": round(end - start, 3),
            "tok_s": round(produced / (end - start), 2)}  # fmt: skip


def prefill_ours(core, ids, params_cls) -> float:
    core.add(f"p{time.perf_counter()}", ids, params_cls(max_tokens=1, temperature=0))
    start = time.perf_counter()
    while core.has_work():
        core.step()
    return time.perf_counter() - start


def prefill_reference(torch, model, ids) -> float:
    with torch.inference_mode():
        start = time.perf_counter()
        model(torch.tensor([ids]), logits_to_keep=1)
        return time.perf_counter() - start


def llama_cpp_section(args, model: pathlib.Path, vocab: int, report: dict) -> dict:
    """llama.cpp's figures on the same model and threads, and the ratios ours/llama.cpp."""
    folder = None if args.peer_llama_cpp == "none" else pathlib.Path(args.peer_llama_cpp)
    if not peer_llama_cpp.missing(folder):
        print("llama.cpp ...", file=sys.stderr)
    section = peer_llama_cpp.measure(
        folder, model, args.threads, prefill_tokens=args.prefill_tokens,
        new_tokens=args.new_tokens,
        stream_prompts=token_prompts(args.streams, args.prompt_tokens, vocab),
        workdir=pathlib.Path(tempfile.mkdtemp(prefix="bench-engine-llama-server-")))  # fmt: skip
    if "absent" in section:
        return section
    streams = f"streams_{args.streams}"
    section.update(peer_llama_cpp.ratios(
        report["single_stream"]["ours"]["decode_tok_s"],
        report[f"prefill_{args.prefill_tokens}"]["ours_tok_s"],
        report[streams]["ours"]["tok_s"] if streams in report else 0.0,
        section, tg=f"tg{args.new_tokens}", pp=f"pp{args.prefill_tokens}",
        streams=streams))  # fmt: skip
    print(f"llama.cpp: {orjson.dumps(section).decode()}", file=sys.stderr)
    return section


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.engine", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default="default",
                        help="default, a GGUF, an HF folder, or synthetic-1b")  # fmt: skip
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--weights",
        choices=("native", "fp32", "bf16"),
        default="native",
        help="how our engine holds the matrices (transformers: fp32)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--peer-llama-cpp",
        default=str(peer_llama_cpp.DEFAULT_DIR),
        metavar="DIR",
        help="llama.cpp build: DIR/bin/llama-bench, llama-server (make bench-peers); none: skip",
    )
    parser.add_argument("--kernels", choices=("auto", *KERNEL_VARIANTS), default="auto",
                        help="our quantized kernels' build (sets TANDEM_KERNELS); auto: the "
                        "best this CPU runs")  # fmt: skip
    g = parser.add_argument_group("speculation mode (bench/engine_spec.py)")
    g.add_argument(
        "--speculation",
        action="store_true",
        help="instead: speculation off against on, input-grounded workload",
    )
    g.add_argument("--speculation-on", default="ngram", help="EngineConfig.speculation when on")
    g.add_argument("--tasks", type=int, default=8, help="one-stream tasks (bench/grounded.py)")
    g.add_argument("--rounds", type=int, default=1, help="passes over the tasks")
    g.add_argument("--seed", type=int, default=0, help="which texts the tasks draw")
    args = parser.parse_args(argv)
    if args.kernels != "auto":
        os.environ["TANDEM_KERNELS"] = args.kernels  # read when the kernels first load
    if args.speculation:
        engine_spec.check_args(parser, args)

    from libs.common.log import setup_logging

    setup_logging(level="warning")
    if args.speculation:
        return engine_spec.run(args)
    import torch

    from libs.common.engine.config import EngineConfig
    from libs.common.engine.core.sampling_params import SamplingParams
    from libs.common.engine.load.source import resolve_model_path
    from libs.common.engine.step_loop import EngineCore

    torch.set_num_threads(args.threads)
    report: dict = {"machine": {"cpu": platform.processor() or platform.machine(),
                                "cores": os.cpu_count(), "threads": args.threads,
                                "weights": args.weights,
                                "torch": torch.__version__,
                                "loadavg_start": os.getloadavg()}}  # fmt: skip
    if args.model == engine_1b.MODEL_NAME:
        engine_1b.run(args, report)
        report["machine"].update(kernels_used(args.kernels))
        emit(report, args.json)
        return 0
    import transformers

    print("measuring bounds ...", file=sys.stderr)
    copy_bw = measure_copy_bandwidth(torch)
    read_bw = measure_read_bandwidth(torch)
    matmul_torch = measure_matmul_rate(torch)
    matmul_onednn = measure_onednn_rate(torch)
    matmul = max(matmul_torch, matmul_onednn)
    budget = args.streams * (args.prompt_tokens + args.new_tokens)
    kv_mb = max(256, budget * 47 // 1024 + 64)  # the default model's KV is ~46 KiB per token
    core = EngineCore(EngineConfig(model=args.model, num_threads=args.threads,
                                   weights=args.weights,
                                   max_num_batched_tokens=max(2048, args.prefill_tokens),
                                   max_num_seqs=max(args.streams, 1),
                                   kv_cache_mb=kv_mb,
                                   enable_prefix_cache=False))  # fmt: skip
    cfg = core.model.config
    # What one decode step reads in the form the engine holds them (native: the GGUF's
    # quantized blocks; fp32 would be 4 bytes a weight).
    weight_bytes = core.model.weight_bytes_per_token()
    report["bounds"] = {
        "copy_bandwidth_gb_s": round(copy_bw / 1e9, 2),
        "matmul_gflop_s": round(matmul / 1e9, 1),
        "matmul_torch_gflop_s": round(matmul_torch / 1e9, 1),
        "matmul_onednn_gflop_s": round(matmul_onednn / 1e9, 1),
        "weights": cfg.num_params,
        "read_bandwidth_gb_s": round(read_bw / 1e9, 2),
        "single_stream_bound_tok_s": round(copy_bw / weight_bytes, 2),
        "single_stream_read_bound_tok_s": round(read_bw / weight_bytes, 2),
        "compute_bound_tok_s": round(matmul / (2 * cfg.num_params), 1),
        # A batch-B decode step reads every weight once and does B x 2 FLOP per weight:
        # it takes at least the longer of the two.
        "decode_roofline_tok_s": round(
            args.streams / max(weight_bytes / read_bw, args.streams * 2 * cfg.num_params / matmul),
            1,
        ),
    }
    print(f"bounds: {orjson.dumps(report['bounds']).decode()}", file=sys.stderr)
    path = pathlib.Path(resolve_model_path(args.model))
    print("loading transformers ...", file=sys.stderr)
    load_kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    folder = path.parent if path.suffix == ".gguf" else path
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, **load_kwargs
    ).eval()

    def side_by_side(name: str, n: int) -> None:
        prompts = token_prompts(n, args.prompt_tokens, cfg.vocab_size)
        # Warm-up of both sides on the same shapes (oneDNN builds kernels per shape).
        run_ours(core, prompts, 2, SamplingParams)
        run_reference(torch, ref, prompts, 2)
        print(f"{name}: ours ...", file=sys.stderr)
        ours = run_ours(core, prompts, args.new_tokens, SamplingParams)
        print(f"{name}: transformers ...", file=sys.stderr)
        theirs = run_reference(torch, ref, prompts, args.new_tokens)
        entry = {"ours": ours, "transformers": theirs,
                 "ratio": round(ours["tok_s"] / theirs["tok_s"], 2)}  # fmt: skip
        if n == 1:
            bound = report["bounds"]["single_stream_bound_tok_s"]
            entry["fraction_of_bandwidth_bound"] = round(ours["decode_tok_s"] / bound, 3)
            read = report["bounds"]["single_stream_read_bound_tok_s"]
            entry["fraction_of_read_bandwidth_bound"] = round(ours["decode_tok_s"] / read, 3)
        else:
            bound = report["bounds"]["compute_bound_tok_s"]
            entry["fraction_of_compute_bound"] = round(ours["tok_s"] / bound, 3)
            entry["decode_fraction_of_compute_bound"] = round(ours["decode_tok_s"] / bound, 3)
            roof = report["bounds"]["decode_roofline_tok_s"]
            entry["decode_fraction_of_roofline"] = round(ours["decode_tok_s"] / roof, 3)
        report[name] = entry
        print(f"{name}: {orjson.dumps(entry).decode()}", file=sys.stderr)

    side_by_side("single_stream", 1)
    side_by_side(f"streams_{args.streams}", args.streams)
    print("prefill ...", file=sys.stderr)
    ids = token_prompts(1, args.prefill_tokens, cfg.vocab_size)[0]
    prefill_ours(core, ids[:64], SamplingParams)  # warm the kernels for this size class
    ours_s = min(prefill_ours(core, ids, SamplingParams) for _ in range(2))
    theirs_s = min(prefill_reference(torch, ref, ids) for _ in range(2))
    report[f"prefill_{args.prefill_tokens}"] = {
        "ours_s": round(ours_s, 3), "transformers_s": round(theirs_s, 3),
        "speedup": round(theirs_s / ours_s, 2),
        "ours_tok_s": round(len(ids) / ours_s, 1),
    }  # fmt: skip
    streams = f"streams_{args.streams}"
    if streams in report and args.streams > 1:
        report[streams].update(end_to_end_bound(
            report[streams], args.streams * args.prompt_tokens, 2 * cfg.num_params, matmul,
            len(ids) / ours_s))  # fmt: skip
        report["verdicts"] = verdicts(report, streams, f"prefill_{args.prefill_tokens}")
    report["llama_cpp"] = llama_cpp_section(args, path, cfg.vocab_size, report)
    report["machine"]["loadavg_end"] = os.getloadavg()
    if args.weights == "native":
        report["machine"].update(kernels_used(args.kernels))
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
