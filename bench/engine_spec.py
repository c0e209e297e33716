"""bench.engine's speculation mode: the engine with speculative decoding off and on, in one
run, on the input-grounded workload.

    python -m bench.engine --speculation --new-tokens 256 --tasks 8 --rounds 2 --json

Two engines in one process, the same model, threads and settings but `speculation`:
"off" and `--speculation-on` ("ngram", EngineConfig.speculation). The workload is
bench/grounded.py's: edits, extractions and summaries of this repository's docs and code,
whose answers quote their prompt, as chat prompts, greedy, at most `--new-tokens` each,
ended by EOS (both engines generate the same tokens, so the same counts). Cases:
- `one_stream`: `--tasks` tasks one at a time;
- `one_stream_json_schema`: the same tasks asking for `{"answer": "..."}`, under that JSON
  schema's grammar (grounded.SCHEMA);
- `streams_<N>`: `--streams` tasks at once.
Each request runs on both engines, the order alternating from one to the next so that the
machine's slow moments fall on both; `--rounds` passes. Decode tok/s counts the tokens
after the first and the steps that make them (one stream: pooled over the tasks; N streams:
the steps after every stream has its first token). Per case: both sides' figures, `ratio`
(on / off decode tok/s; `round_ratios`: each round's, whose spread shows the run's noise),
`identical` (every request's tokens equal on both) and the `acceptance` of the drafts
(accepted / proposed: the on engine's speculator totals over the case). `verdicts`: issue
40's goals (identical greedy output; one stream >= 1.8x, with the JSON schema >= 1.5x, N
streams >= 1.0x).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time
from typing import Any

from bench import grounded
from bench.engine_measure import kernels_used
from bench.report import emit


@dataclasses.dataclass
class Side:
    """One engine and what it measured in the current case."""

    name: str
    core: Any
    decode_tokens: int = 0
    decode_s: float = 0.0
    output_tokens: int = 0
    seconds: float = 0.0

    def reset(self) -> None:
        self.decode_tokens, self.decode_s, self.output_tokens, self.seconds = 0, 0.0, 0, 0.0

    def run(self, prompts: list[list[int]], params: Any) -> list[list[int]]:
        """The prompts as one batch to the end; their tokens, in order."""
        tag = time.perf_counter_ns()
        ids = [f"s{tag}-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts, strict=True):
            self.core.add(rid, prompt, params)
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        start = time.perf_counter()
        while self.core.has_work():
            decoding = all(tokens.values())  # every stream has its first token
            began = time.perf_counter()
            outputs = self.core.step()
            took = time.perf_counter() - began
            made = sum(len(o.token_ids) for o in outputs)
            if decoding:
                self.decode_tokens += made
                self.decode_s += took
            for o in outputs:
                tokens[o.request_id] += o.token_ids
        self.seconds += time.perf_counter() - start
        self.output_tokens += sum(len(t) for t in tokens.values())
        return [tokens[rid] for rid in ids]

    def figures(self) -> dict[str, Any]:
        return {
            "output_tokens": self.output_tokens,
            "seconds": round(self.seconds, 3),
            "tok_s": round(self.output_tokens / max(self.seconds, 1e-9), 2),
            "decode_tokens": self.decode_tokens,
            "decode_tok_s": round(self.decode_tokens / max(self.decode_s, 1e-9), 2),
        }


def first_difference(a: list[int], b: list[int]) -> int:
    """The first position where two token lists differ (the shorter's length if one is
    the other's prefix)."""
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


def drafts(core: Any) -> tuple[int, int]:
    """(proposed, accepted) draft tokens so far: the engine's speculator totals, (0, 0)
    without one (speculation off)."""
    spec = getattr(core, "speculator", None)
    return (spec.num_proposed, spec.num_accepted) if spec is not None else (0, 0)


def compare(off: Side, on: Side, batches: list[list[list[int]]], params: Any,
            rounds: int) -> dict[str, Any]:  # fmt: skip
    """Every batch on both engines, `rounds` times, the order alternating."""
    for side in (off, on):
        side.reset()
    before = drafts(on.core)
    mismatches: list[dict[str, int]] = []
    turn = 0
    round_ratios = []
    for r in range(rounds):
        at = {side.name: (side.decode_tokens, side.decode_s) for side in (off, on)}
        for b, batch in enumerate(batches):
            first, second = (off, on) if turn % 2 == 0 else (on, off)
            turn += 1
            got = {first.name: first.run(batch, params)}
            got[second.name] = second.run(batch, params)
            for i, (a, z) in enumerate(zip(got["off"], got["on"], strict=True)):
                if a != z:
                    mismatches.append({"round": r, "batch": b, "request": i,
                                       "first_difference": first_difference(a, z)})  # fmt: skip
        speed = {}  # this round's decode tok/s of each side
        for side in (off, on):
            tokens, took = side.decode_tokens - at[side.name][0], side.decode_s - at[side.name][1]
            speed[side.name] = tokens / max(took, 1e-9)
        round_ratios.append(round(speed["on"] / max(speed["off"], 1e-9), 3))
    proposed, accepted = (x - y for x, y in zip(drafts(on.core), before, strict=True))
    entry: dict[str, Any] = {"off": off.figures(), "on": on.figures()}
    speed = (entry["on"]["decode_tok_s"], entry["off"]["decode_tok_s"])
    entry["ratio"] = round(speed[0] / max(speed[1], 1e-9), 3)
    entry["round_ratios"] = round_ratios  # the spread: what one run's noise is
    entry["identical"] = not mismatches
    entry["mismatches"] = mismatches[:8]
    entry["drafts_proposed"], entry["drafts_accepted"] = proposed, accepted
    entry["acceptance"] = round(accepted / proposed, 3) if proposed else None
    return entry


def verdicts(report: dict[str, Any], streams: str) -> dict[str, bool]:
    cases = ("one_stream", "one_stream_json_schema", streams)
    return {
        "greedy_identical": all(report[c]["identical"] for c in cases),
        "one_stream_1.8x": report["one_stream"]["ratio"] >= 1.8,
        "one_stream_json_schema_1.5x": report["one_stream_json_schema"]["ratio"] >= 1.5,
        f"{streams}_1.0x": report[streams]["ratio"] >= 1.0,
    }


def engine_config(args: argparse.Namespace, speculation: str, streams: int, prompt_len: int):
    from libs.common.engine.config import EngineConfig

    budget = streams * (prompt_len + args.new_tokens + 16)
    return EngineConfig(model=args.model, num_threads=args.threads, weights=args.weights,
                        max_num_seqs=streams, max_num_batched_tokens=2048,
                        kv_cache_mb=max(256, budget * 47 // 1024 + 64),
                        enable_prefix_cache=False, speculation=speculation)  # fmt: skip


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for flag in ("tasks", "rounds", "streams", "threads", "new_tokens"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}: must be >= 1")


def run(args: argparse.Namespace) -> int:
    """The speculation mode of bench.engine (flags checked by check_args)."""
    import torch

    from libs.common.engine.core.sampling_params import SamplingParams
    from libs.common.engine.load.source import load_tokenizer
    from libs.common.engine.step_loop import EngineCore
    from libs.common.grammar import build

    torch.set_num_threads(args.threads)
    tasks = grounded.tasks(max(args.tasks, args.streams), seed=args.seed)
    report: dict[str, Any] = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "threads": args.threads, "weights": args.weights, "torch": torch.__version__,
                    "loadavg_start": os.getloadavg()},
        "config": {"model": args.model, "speculation_on": args.speculation_on,
                   "tasks": args.tasks, "streams": args.streams, "rounds": args.rounds,
                   "max_tokens": args.new_tokens, "seed": args.seed,
                   "workload": "bench/grounded.py", "kinds": grounded.KINDS,
                   "sources": [t.source for t in tasks]},
    }  # fmt: skip
    tok = load_tokenizer(args.model)[0]

    def ids(task: grounded.Task, as_json: bool) -> list[int]:
        text = tok.apply_chat_template(task.messages(as_json))
        return tok.encode(text, add_special=False)

    longest = max(len(ids(t, True)) for t in tasks)
    off = Side("off", EngineCore(engine_config(args, "off", args.streams, longest)))
    on = Side("on", EngineCore(engine_config(args, args.speculation_on, args.streams, longest)))

    plain = SamplingParams(max_tokens=args.new_tokens, temperature=0)
    schema = dataclasses.replace(plain, grammar=build.json_schema(grounded.SCHEMA))
    streams = f"streams_{args.streams}"
    cases = {
        "one_stream": ([[ids(t, False)] for t in tasks[: args.tasks]], plain),
        "one_stream_json_schema": ([[ids(t, True)] for t in tasks[: args.tasks]], schema),
        streams: ([[ids(t, False) for t in tasks[: args.streams]]], plain),
    }
    for name, (batches, params) in cases.items():
        warm = dataclasses.replace(params, max_tokens=min(4, args.new_tokens))
        for side in (off, on):  # oneDNN builds kernels per shape; the grammar compiles once
            side.run(batches[0], warm)
        print(f"{name}: {len(batches)} batch(es) x {args.rounds} round(s) ...", file=sys.stderr)
        report[name] = compare(off, on, batches, params, args.rounds)
    report["verdicts"] = verdicts(report, streams)
    # what a verified draft cost on this host (the policy's StepCosts, relative to a
    # one-token step, by draft length): the ratios above follow it
    report["step_costs"] = on.core.speculator.costs.stats() if on.core.speculator else None
    report["machine"].update(kernels_used(args.kernels))
    report["machine"]["loadavg_end"] = os.getloadavg()
    emit(report, args.json)
    return 0
