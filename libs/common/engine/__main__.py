"""Command line: `python -m libs.common.engine generate --prompt TEXT [...] --json`.

Prints one JSON object on stdout (`token_ids`: the generated ids only, `text`,
`finish_reason`, token counts, timings with `tokens_per_s`); logs go to stderr.
`--ignore-eos` generates exactly `--max-tokens` tokens (benchmarks). Checks call this,
so its flags and keys stay stable.
"""

from __future__ import annotations

import argparse
import sys
import time

import orjson

from libs.common.log import setup_logging


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m libs.common.engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt and print the result")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    gen.add_argument(
        "--ignore-eos", action="store_true", help="generate max-tokens tokens, past end-of-sequence"
    )
    gen.add_argument("--model", default="default", help="'default', a .gguf file or an HF folder")
    gen.add_argument(
        "--weights",
        choices=("native", "fp32", "bf16"),
        default="native",
        help="matrices as stored (native: quantized blocks), dequantized fp32, or bf16",
    )
    gen.add_argument("--kv-dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    gen.add_argument(
        "--kernel-choice",
        choices=("measure", "native"),
        default="measure",
        help="measure: time the quantized products per shape at start-up, keep the fastest",
    )
    gen.add_argument(
        "--kernel-copy-mb", type=int, default=0, help="MiB of fp32 weight copies allowed"
    )
    gen.add_argument(
        "--speculation",
        choices=("ngram", "draft", "off"),
        default=None,
        help="speculative decoding (same greedy output): ngram drafts (the default), "
        "drafts by --draft-model, or off",
    )
    gen.add_argument(
        "--draft-model",
        default=None,
        help="a small model of the same tokenizer that drafts ('default', .gguf or HF "
        "folder); implies --speculation draft",
    )
    gen.add_argument(
        "--speculation-max-draft", type=int, default=3, help="draft tokens per step at most"
    )
    gen.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument("--log-level", default="warning")
    return parser


def generate(args: argparse.Namespace) -> dict:
    from libs.common.engine.config import EngineConfig
    from libs.common.engine.core.sampling_params import SamplingParams
    from libs.common.engine.step_loop import EngineCore

    start = time.perf_counter()
    config = EngineConfig(model=args.model, num_threads=args.threads, kv_cache_mb=256,
                          weights=args.weights, kv_dtype=args.kv_dtype,
                          kernel_choice=args.kernel_choice,
                          kernel_copy_mb=args.kernel_copy_mb,
                          speculation=args.speculation or ("draft" if args.draft_model
                                                           else "ngram"),
                          draft_model=args.draft_model,
                          speculation_max_draft=args.speculation_max_draft)  # fmt: skip
    core = EngineCore(config)
    tok = core.tokenizer
    if tok is None:
        raise ValueError(f"{args.model}: the model has no tokenizer to encode the prompt")
    text = args.prompt
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": text}])
    prompt_ids = tok.encode(text)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    loaded = time.perf_counter()
    core.add("cli", prompt_ids, params)
    ids: list[int] = []
    parts: list[str] = []
    reason = None
    first = None
    while core.has_work():
        for out in core.step():
            first = first or time.perf_counter()
            ids.extend(out.token_ids)
            parts.append(out.text)
            if out.finished:
                reason = out.finish_reason
    end = time.perf_counter()
    return {
        "model": core.model.model_id,
        "token_ids": ids,
        "text": "".join(parts),
        "finish_reason": reason,
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(ids),
        "load_s": round(loaded - start, 3),
        "ttft_s": round((first or end) - loaded, 3),
        "tokens_per_s": round(len(ids) / max(end - loaded, 1e-9), 2),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    setup_logging(level=args.log_level)
    try:
        result = generate(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.write(orjson.dumps(result).decode() + "\n")
    else:
        sys.stdout.write(result["text"] + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
