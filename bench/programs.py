"""What the prefix cache is worth to LLM programs: the three llm_programs examples, run as
batches against Tandem with the workers' prefix cache on, then against the same topology
with it off (`--no-prefix-cache true`), the same calls (greedy, so the same outputs).

Each configuration is started as local processes (bench.deployments: its own
nats-server, `make run`'s one prefill and one decode worker, the pool off in both, so the
workers' own caches are the only difference) and stopped after its runs. Per example:
wall time of the batch, requests, prompt and cached tokens (as the router reports them);
then the speed-up (wall time without the cache / with it) and whether the outputs agree.
JSON on stdout (and to --json).

    python -m bench.programs
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench.deployments import Deployment, Topology
from llm_programs import Router, State
from llm_programs.examples import EXAMPLES
from scripts.cluster import REPO

CONFIGS = ("prefix-cache", "no-prefix-cache")


def topologies(a: argparse.Namespace) -> dict[str, Topology]:
    common = ["--num-threads", str(a.threads), "--transport", "tcp", "--no-pool", "true"]
    return {
        "prefix-cache": Topology("prefix-cache", 1, 1, common, note="workers' prefix cache"),
        "no-prefix-cache": Topology(
            "no-prefix-cache", 1, 1, [*common, "--no-prefix-cache", "true"], note="no prefix cache"
        ),
    }


def tally(states: list[State]) -> dict[str, Any]:
    """Requests and tokens over every call the states made (branches' included)."""
    calls = [c for s in states for c in s.calls]
    usage = [c.usage for c in calls if c.kind != "render"]
    prompt = sum(u.prompt_tokens for u in usage)
    cached = sum(u.cached_tokens for u in usage)
    kinds: dict[str, int] = {}
    for c in calls:
        kinds[c.kind] = kinds.get(c.kind, 0) + 1
    return {
        "requests": kinds,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": round(cached / prompt, 3) if prompt else 0.0,
    }


def outputs(states: list[State]) -> list[dict[str, Any]]:
    return [{k: v for k, v in s.vars.items()} for s in states]


async def run_example(name: str, url: str, a: argparse.Namespace) -> dict[str, Any]:
    example = importlib.import_module(f"llm_programs.examples.{name}")
    router = Router(url, timeout=a.timeout)
    t0 = time.perf_counter()
    states = await example.program.arun_batch(
        router, example.inputs(a.n[name]), concurrency=a.concurrency
    )
    seconds = time.perf_counter() - t0
    return {"seconds": round(seconds, 2), **tally(states), "outputs": outputs(states)}


async def run_config(name: str, topo: Topology, a: argparse.Namespace) -> dict[str, Any]:
    workdir = a.workdir / name
    shutil.rmtree(workdir, ignore_errors=True)  # no KV events of an earlier run
    system = Deployment(topo, workdir)
    load_before = os.getloadavg()
    try:
        await system.start(a.ready_timeout)
        base = system.url.removesuffix("/v1")
        # One short program first: one-time costs (first allocation, lazy imports) do not
        # land on the first example. It shares no prefix with them.
        warm = importlib.import_module("llm_programs.examples.json_extraction")
        await warm.program.arun(Router(base, timeout=a.timeout), text="Warm-up.")
        runs = {e: await run_example(e, base, a) for e in a.examples}
    finally:
        system.stop()
    return {
        "note": topo.note,
        "runs": runs,
        "load": {"before": load_before, "after": os.getloadavg()},
    }


def compare(results: dict[str, dict[str, Any]], examples: list[str]) -> dict[str, Any]:
    """Per example: the speed-up from the cache and whether the outputs agree."""
    out = {}
    for e in examples:
        on, off = (results[c]["runs"][e] for c in CONFIGS)
        out[e] = {
            "seconds": {"prefix-cache": on["seconds"], "no-prefix-cache": off["seconds"]},
            "speedup": round(off["seconds"] / on["seconds"], 2),
            "cached_share": on["cached_share"],
            "same_outputs": on["outputs"] == off["outputs"],
        }
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.programs",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--examples", default=",".join(EXAMPLES), help="comma list")
    p.add_argument("--chats", type=int, default=8, help="multi_turn_chat conversations")
    p.add_argument("--questions", type=int, default=4, help="branch_and_judge questions")
    p.add_argument("--texts", type=int, default=8, help="json_extraction texts")
    p.add_argument("--concurrency", type=int, default=4, help="programs in flight at most")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per call at most")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--workdir", type=Path, default=REPO / "run" / "bench-programs")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--outputs", action="store_true", help="keep every program's outputs")
    return p


async def _main(a: argparse.Namespace) -> int:
    a.examples = [e.strip() for e in a.examples.split(",") if e.strip()]
    bad = [e for e in a.examples if e not in EXAMPLES]
    if bad or not a.examples:
        raise ValueError(f"--examples: unknown {bad}; choose from {EXAMPLES}")
    for flag in ("chats", "questions", "texts", "concurrency", "threads"):
        if getattr(a, flag) < 1:
            raise ValueError(f"--{flag}: must be >= 1")
    a.n = dict(zip(EXAMPLES, (a.chats, a.questions, a.texts), strict=True))
    topo = topologies(a)
    results = {}
    for name in CONFIGS:
        print(f"== {name} (load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
        results[name] = await run_config(name, topo[name], a)
    summary = compare(results, a.examples)
    if not a.outputs:
        for r in results.values():
            for run in r["runs"].values():
                run.pop("outputs")
    report = {
        "summary": summary,
        "configs": results,
        "args": {k: str(v) for k, v in vars(a).items()},
    }
    text = json.dumps(report, indent=2)
    print(text)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(text + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return asyncio.run(_main(parser().parse_args(argv)))
    except ValueError as e:
        print(f"bench.programs: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
