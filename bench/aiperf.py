"""NVIDIA AIPerf and bench.serve on the same Mooncake trace (docs/benchmarks.md, "AIPerf").

    python -m bench.aiperf trace --trace T.jsonl --num-prompts 20 --trace-block-len 8 \
        --trace-time-scale 8 --trace-output-scale 0.1 --out aiperf-trace.jsonl
    python -m bench.aiperf compare bench-serve.json aiperf-dir/profile_export_aiperf.json
    python -m bench.aiperf tokenizer --hf-home /tmp/hf

`trace` writes the slice bench.serve's trace workload replays (the same flags, the same
scaling: bench/workloads.py, `TraceReplay`) as a Mooncake file for AIPerf's
`--custom-dataset-type mooncake_trace --isl-block-size <block>`: lengths, outputs and
timestamps already scaled, the hash ids kept (AIPerf makes each id one block of `block`
tokens, as bench.serve makes it `block` words: one token each). `compare` prints the
figures both report, side by side. `tokenizer` puts the model's tokenizer where AIPerf
reads it offline. AIPerf is not a dependency of Tandem: it runs from a
virtual environment of its own (the recipe in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

TRACE_BLOCK = 512  # tokens of one block of a Mooncake trace
TOKENIZER = "tandem/smollm2-tokenizer"  # the name `tokenizer` gives it in the cache


def scaled(rec: dict[str, Any], block: int, output_scale: float, time_scale: float) -> dict:
    """One trace record as bench.serve replays it: `block` tokens a hash id, an input of
    round(input_length x block / 512) tokens (within its blocks: AIPerf's last block holds
    1..block tokens), outputs x `output_scale` (>= 1), timestamps x `time_scale` (ms)."""
    ids = list(rec["hash_ids"])
    n = max(1, round(int(rec["input_length"]) * block / TRACE_BLOCK))
    if ids:
        n = min(max(n, (len(ids) - 1) * block + 1), len(ids) * block)
    out = max(1, round(int(rec["output_length"]) * output_scale))
    return {"timestamp": round(float(rec["timestamp"]) * time_scale), "input_length": n,
            "output_length": out, "hash_ids": ids}  # fmt: skip


def write_trace(a: argparse.Namespace) -> int:
    lines = []
    with open(a.trace) as f:
        for line in f:
            if len(lines) >= a.num_prompts:
                break
            if line.strip():
                rec = scaled(json.loads(line), a.trace_block_len, a.trace_output_scale,
                             a.trace_time_scale)  # fmt: skip
                lines.append(json.dumps(rec))
    a.out.write_text("\n".join(lines) + "\n")
    print(f"{a.out}: {len(lines)} requests; the same slice through each tool:\n")
    print("\n".join(commands(a)))
    return 0


def commands(a: argparse.Namespace, url: str = "http://127.0.0.1:8000") -> list[str]:
    """bench.serve's command on the original trace, AIPerf's on the scaled file."""
    same = (f"--num-prompts {a.num_prompts} --trace-block-len {a.trace_block_len} "
            f"--trace-time-scale {a.trace_time_scale} "
            f"--trace-output-scale {a.trace_output_scale}")  # fmt: skip
    return [
        f".venv/bin/python -m bench.serve --base-url {url}/v1 --workload trace "
        f"--trace {a.trace} {same} --json bs.json",
        f"HF_HUB_OFFLINE=1 aiperf profile --model default --tokenizer {TOKENIZER} --url {url} "
        "--endpoint-type chat --streaming --custom-dataset-type mooncake_trace "
        f"--input-file {a.out} --fixed-schedule --isl-block-size {a.trace_block_len} "
        "--use-legacy-max-tokens --use-server-token-count --extra-inputs ignore_eos:true "
        "--extra-inputs temperature:0 --artifact-dir ap --ui-type none --no-gpu-telemetry",
    ]


def write_tokenizer(a: argparse.Namespace) -> int:
    """The default model's tokenizer where AIPerf 0.13.0 finds it offline: the Hugging Face
    cache under `--hf-home` (it loads no local folder path with HF_HUB_OFFLINE=1)."""
    from libs.common.engine.load.source import load_tokenizer

    tok, _, max_len = load_tokenizer(a.model)
    repo = a.hf_home / "hub" / f"models--{a.name.replace('/', '--')}"
    snapshot = repo / "snapshots" / "local"
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot / "tokenizer.json").write_text(tok.tokenizer.to_str())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len}
    (snapshot / "tokenizer_config.json").write_text(json.dumps(config))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text("local")
    print(f"HF_HOME={a.hf_home} HF_HUB_OFFLINE=1 aiperf profile --tokenizer {a.name} ...")
    return 0


def figures(serve: dict[str, Any], aiperf: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """name -> (bench.serve, AIPerf). AIPerf's inter-token latency is per request,
    (latency - TTFT) / (tokens - 1): bench.serve's TPOT."""
    s = serve["summary"]

    def ap(name: str, stat: str = "avg") -> float:
        return float(aiperf[name][stat])

    return {
        "requests/s": (s["request_throughput"], ap("request_throughput")),
        "output tokens/s": (s["output_throughput"], ap("output_token_throughput")),
        "mean input tokens": (s["prompt_tokens"] / s["completed"], ap("input_sequence_length")),
        "mean output tokens": (
            s["completion_tokens"] / s["completed"],
            ap("output_sequence_length"),
        ),
        "TTFT mean ms": (s["ttft_ms"]["mean"], ap("time_to_first_token")),
        "TTFT p50 ms": (s["ttft_ms"]["median"], ap("time_to_first_token", "p50")),
        "TTFT p90 ms": (s["ttft_ms"]["p90"], ap("time_to_first_token", "p90")),
        "TPOT (AIPerf ITL) mean ms": (s["tpot_ms"]["mean"], ap("inter_token_latency")),
        "E2E mean ms": (s["e2e_ms"]["mean"], ap("request_latency")),
    }


def compare(a: argparse.Namespace) -> int:
    rows = figures(json.loads(a.serve.read_text()), json.loads(a.aiperf.read_text()))
    print("| figure | bench.serve | AIPerf | AIPerf / bench.serve |\n| --- | ---: | ---: | ---: |")
    for name, (ours, theirs) in rows.items():
        ratio = f"{theirs / ours:.3f}" if ours else "-"
        print(f"| {name} | {ours:.1f} | {theirs:.1f} | {ratio} |")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.aiperf", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("trace", help="the scaled Mooncake slice for AIPerf")
    t.add_argument("--trace", type=Path, required=True)
    t.add_argument("--num-prompts", type=int, default=20)
    t.add_argument("--trace-block-len", type=int, default=16)
    t.add_argument("--trace-output-scale", type=float, default=0.1)
    t.add_argument("--trace-time-scale", type=float, default=0.1)
    t.add_argument("--out", type=Path, required=True)
    k = sub.add_parser("tokenizer", help="the model's tokenizer into an HF cache, for AIPerf")
    k.add_argument("--hf-home", type=Path, required=True)
    k.add_argument("--model", default="default", help="a --model value of the workers")
    k.add_argument("--name", default=TOKENIZER, help="its name in the cache")
    c = sub.add_parser("compare", help="bench.serve's --json against AIPerf's JSON export")
    c.add_argument("serve", type=Path)
    c.add_argument("aiperf", type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.command == "trace":
        if a.num_prompts < 1 or a.trace_block_len < 1 or a.trace_output_scale <= 0:
            print("bench.aiperf: counts and scales must be positive", file=sys.stderr)
            return 2
        return write_trace(a)
    return write_tokenizer(a) if a.command == "tokenizer" else compare(a)


if __name__ == "__main__":
    sys.exit(main())
