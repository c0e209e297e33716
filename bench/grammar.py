"""Grammar benchmark: constrained against unconstrained decoding, and grammar compile time.

    python -m bench.grammar --json

On the engine directly (EngineCore, the default model, no router), in one process:
- decode cost per token at each stream count (1 and 32 by default): the same prompts,
  greedy, `--new-tokens` each, unconstrained on one engine and under a JSON schema on a
  second one, their steps alternated (one step of each in turn, the order flipping every
  time) so that the machine's noise hits both alike; `--rounds` such runs. The schema is an
  array of at least 64 person objects (name, age, email, an address, tags): a typical
  object, repeated so that no stream can finish before `--new-tokens`, so both modes
  generate exactly the same number of tokens (unconstrained runs ignore EOS; constrained
  ones need not: EOS is masked until the array is complete). Only steps after every
  stream has its first token count (the decode phase); tok/s is their tokens over their
  time, pooled over the rounds. `ratio` = constrained / unconstrained tok/s.
- compile time of the person schema (libs/common/grammar/compiler.py): building a compiler
  (its tokenizer: once per process), the first compile on a fresh compiler, a cold compile
  (a schema not seen before, on a compiler that has compiled others) and the first mask of
  that grammar (llguidance builds lexer states lazily: a request pays this too), and a
  cache hit (`check`, and `matcher`: a hit plus the copy a request gets), medians over
  `--compile-iters`.
`verdicts` holds the goal: at most 10% slower per token at the largest stream count.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import platform
import statistics
import sys
import time
from typing import Any

import orjson

from bench.report import emit

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org|net)$"},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 32},
                "city": {"type": "string", "minLength": 1, "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]},
                 "maxItems": 3},
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}  # fmt: skip
MIN_PEOPLE = 64  # far more than any --new-tokens can hold: no constrained stream ends early


def people_schema() -> dict[str, Any]:
    return {"type": "array", "items": PERSON, "minItems": MIN_PEOPLE}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.grammar", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--streams", default="1,32", help="comma-separated stream counts")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="alternations of the two modes")
    p.add_argument("--compile-iters", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[int]:
    """The stream counts; a usage error (exit 2) naming the flag for a bad value."""
    try:
        streams = [int(s) for s in args.streams.split(",")]
    except ValueError:
        p.error(f"--streams: comma-separated integers, got {args.streams!r}")
    if not streams or min(streams) < 1:
        p.error(f"--streams: each count must be >= 1, got {args.streams!r}")
    for flag in ("threads", "prompt_tokens", "rounds", "compile_iters"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}: must be >= 1")
    if args.new_tokens < 3:
        p.error("--new-tokens: must be >= 3 (a decode phase after the first token)")
    return streams


def prompts(n: int, length: int, text_ids: list[int]) -> list[list[int]]:
    """`n` prompts of `length` ids: a request for JSON, then ids that differ per stream."""
    tails = ([100 + (i * 7919 + j * 104729) % 20000 for j in range(length)] for i in range(n))
    return [(text_ids + tail)[:length] for tail in tails]


class Side:
    """One mode's batch on an engine of its own, advanced one step at a time, so that the
    two modes' steps can alternate; counts the decode phase's tokens and seconds."""

    def __init__(self, core, params) -> None:
        self.core, self.params = core, params
        self.runs: list[dict[str, float]] = []

    def start(self, batch: list[list[int]], params=None) -> None:
        tag = time.perf_counter_ns()
        for i, ids in enumerate(batch):
            self.core.add(f"g{tag}-{i}", ids, params or self.params)
        self.streams, self.started = len(batch), set()
        self.tokens, self.seconds, self.lengths = 0, 0.0, []
        self.first, self.text = f"g{tag}-0", ""  # stream 0's text: shows what was generated

    @property
    def done(self) -> bool:
        return not self.core.has_work()

    def step(self) -> None:
        if self.done:
            return
        decoding = len(self.started) == self.streams  # every stream has its first token
        start = time.perf_counter()
        outputs = self.core.step()
        took = time.perf_counter() - start
        if decoding:
            self.tokens += sum(len(o.token_ids) for o in outputs)
            self.seconds += took
        self.started.update(o.request_id for o in outputs if o.token_ids)
        self.lengths += [o.num_output_tokens for o in outputs if o.finished]
        self.text += "".join(o.text for o in outputs if o.request_id == self.first)

    def record(self) -> None:
        self.runs.append({"decode_tokens": self.tokens, "decode_s": self.seconds,
                          "output_tokens": sum(self.lengths), "text": self.text})  # fmt: skip


def run_together(sides: list[Side], batch: list[list[int]], params=None) -> None:
    """Every side's batch to the end, their steps alternated (the order flips each time:
    a slow moment of the machine falls on both modes alike)."""
    for side in sides:
        side.start(batch, params)
    flip = False
    while not all(side.done for side in sides):
        for side in reversed(sides) if flip else sides:
            side.step()
        flip = not flip


def summarize(runs: list[dict[str, float]]) -> dict[str, Any]:
    """Pooled over the rounds: all decode tokens over all their seconds."""
    tokens = sum(r["decode_tokens"] for r in runs)
    tok_s = tokens / max(sum(r["decode_s"] for r in runs), 1e-9)
    return {
        "tok_s": round(tok_s, 2),
        "per_token_ms": round(1e3 / tok_s, 3),
        "tok_s_rounds": [round(r["decode_tokens"] / max(r["decode_s"], 1e-9), 2) for r in runs],
        "output_tokens": runs[0]["output_tokens"],
        "decode_tokens": runs[0]["decode_tokens"],
        "stream_0_text": runs[-1]["text"][:120],
    }


def measure_decode(sides: dict[str, Side], batch: list[list[int]], rounds: int) -> dict:
    """`rounds` runs of the batch in both modes at once, steps alternated."""
    for side in sides.values():
        side.runs.clear()
    for _ in range(rounds):
        run_together(list(sides.values()), batch)
        for side in sides.values():
            side.record()
    entry = {name: summarize(side.runs) for name, side in sides.items()}
    free, bound = entry["unconstrained"], entry["constrained"]
    entry["same_token_counts"] = free["decode_tokens"] == bound["decode_tokens"]
    entry["ratio"] = round(bound["tok_s"] / free["tok_s"], 3)
    entry["slowdown"] = round(1 - entry["ratio"], 3)
    pairs = zip(bound["tok_s_rounds"], free["tok_s_rounds"], strict=True)
    entry["ratio_rounds"] = [round(c / u, 3) for c, u in pairs]
    return entry


def measure_compile(core, iters: int) -> dict[str, float]:
    """Compile figures of the person schema, medians over `iters` (see the docstring)."""
    from libs.common.grammar import build
    from libs.common.grammar.compiler import GrammarCompiler

    def fresh() -> GrammarCompiler:
        c = core.model.config
        return GrammarCompiler(core.tokenizer.tokenizer.to_str(), c.vocab_size,
                               tuple(c.eos_token_ids))  # fmt: skip

    def ms(fn) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    text = build.json_schema(PERSON)
    setup, first = [], []
    for _ in range(iters):
        holder: list[GrammarCompiler] = []
        setup.append(ms(lambda h=holder: h.append(fresh())))
        first.append(ms(lambda h=holder: h[0].check(text)))
    compiler = fresh()
    compiler.check(build.json_schema({"type": "object"}))  # the compiler is warm
    cold, first_mask = [], []
    for i in range(iters):  # a schema not seen before each time: a bound that differs
        variant = copy.deepcopy(PERSON)
        variant["properties"]["name"]["maxLength"] = 25 + i
        variant_text = build.json_schema(variant)
        cold.append(ms(lambda t=variant_text: compiler.check(t)))
        matcher = compiler.matcher(variant_text)
        first_mask.append(ms(matcher.compute_bitmask))  # lexer states are built lazily
    compiler.check(text)
    hit = [ms(lambda: compiler.check(text)) for _ in range(max(iters, 20))]
    copy_hit = [ms(lambda: compiler.matcher(text)) for _ in range(max(iters, 20))]
    compiler.close()
    med = statistics.median
    return {
        "compiler_setup_ms": round(med(setup), 2),
        "first_compile_ms": round(med(first), 3),
        "cold_compile_ms": round(med(cold), 3),
        "cold_first_mask_ms": round(med(first_mask), 3),
        "cache_hit_check_ms": round(med(hit), 4),
        "cache_hit_matcher_ms": round(med(copy_hit), 4),
        "grammar_chars": len(text),
    }


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    streams = check_args(p, args)

    from libs.common.log import setup_logging

    setup_logging(level="warning")
    import torch

    from libs.common.engine.config import EngineConfig
    from libs.common.engine.core.sampling_params import SamplingParams
    from libs.common.engine.step_loop import EngineCore
    from libs.common.grammar import build

    torch.set_num_threads(args.threads)
    report: dict[str, Any] = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "threads": args.threads, "torch": torch.__version__,
                    "loadavg_start": os.getloadavg()},
        "config": {"model": args.model, "streams": streams, "prompt_tokens": args.prompt_tokens,
                   "new_tokens": args.new_tokens, "rounds": args.rounds,
                   "schema": f"array of >= {MIN_PEOPLE} person objects"},
    }  # fmt: skip
    most = max(streams)
    budget = most * (args.prompt_tokens + args.new_tokens + 16)
    config = EngineConfig(model=args.model, num_threads=args.threads, max_num_seqs=most,
                          max_num_batched_tokens=max(2048, most * args.prompt_tokens),
                          kv_cache_mb=max(256, budget * 47 // 1024 + 64),
                          enable_prefix_cache=False)  # fmt: skip
    free, bound = EngineCore(config), EngineCore(config)  # one engine per mode
    grammar = build.json_schema(people_schema())
    bound.grammars.check(grammar)  # compiled once, before any timing
    sides = {
        "unconstrained": Side(free, SamplingParams(max_tokens=args.new_tokens, temperature=0,
                                                   ignore_eos=True)),
        "constrained": Side(bound, SamplingParams(max_tokens=args.new_tokens, temperature=0,
                                                  grammar=grammar)),
    }  # fmt: skip
    text_ids = free.tokenizer.encode("A list of people as JSON, with their addresses:\n")
    for n in streams:
        batch = prompts(n, args.prompt_tokens, text_ids)
        for side in sides.values():  # warm-up: oneDNN builds kernels per shape
            run_together([side], batch, dataclasses.replace(side.params, max_tokens=3))
        print(f"streams_{n}: {args.rounds} rounds of both modes ...", file=sys.stderr)
        entry = measure_decode(sides, batch, args.rounds)
        report[f"streams_{n}"] = entry
        print(f"streams_{n}: {orjson.dumps(entry).decode()}", file=sys.stderr)
    print("compile ...", file=sys.stderr)
    report["compile"] = measure_compile(bound, args.compile_iters)
    print(f"compile: {orjson.dumps(report['compile']).decode()}", file=sys.stderr)
    report["verdicts"] = {
        f"streams_{most}_at_most_10pct_slower": report[f"streams_{most}"]["slowdown"] <= 0.10
    }
    report["machine"]["loadavg_end"] = os.getloadavg()
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
