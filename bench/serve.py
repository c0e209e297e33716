"""Serving benchmark: load an OpenAI-compatible endpoint, streaming, and report latencies.

    python -m bench.serve --workload multi-turn --num-clients 8 --num-rounds 4 \\
        --input-len 128 --output-len 32 --request-rate 4 --round-barrier --plot mt.png

Workloads (bench/workloads.py): `random` prompts, `multi-turn` conversations (N clients x R
rounds, Poisson arrivals with a concurrency cap, optional round barrier), `trace` replay
of a Mooncake trace (equal hash_ids = equal token blocks, lengths and time scaled),
`grounded` tasks whose answers quote their prompt (bench/grounded.py: rewrites, bug fixes,
extractions and summaries of this repository's docs and code; `--grounded-json` asks for
a JSON answer under a schema; send with `--no-ignore-eos`), where speculative decoding pays.
Metrics (bench/metrics.py): TTFT, TPOT, ITL, E2E (mean, median, p90, p99, max), request /
input / output throughput, goodput under --slo, cache hit rate from
usage.prompt_tokens_details.cached_tokens, and per round when the barrier is on.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

from bench import report
from bench.client import Endpoint, RequestResult, send
from bench.driver import Arrivals, drive
from bench.metrics import Slo, per_round, summarize
from bench.workloads import Grounded, MultiTurn, TraceReplay, Workload
from libs.common import event_loop
from scripts.cluster import REPO

DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "conversation_trace.jsonl"


async def benchmark(
    endpoint: Endpoint,
    workload: Workload,
    arrivals: Arrivals,
    slo: Slo | None = None,
    progress: bool = True,
    label: str = "",
) -> dict[str, Any]:
    """Run one workload; return {"summary", "rounds", "requests"} (see bench.metrics)."""
    bar = tqdm(total=workload.total, desc=label or "requests", unit="req", disable=not progress,
               dynamic_ncols=True, file=sys.stderr)  # fmt: skip
    limit = arrivals.max_concurrency or 0
    # One connection per in-flight request: a shared pool must never be the bottleneck.
    conn = aiohttp.TCPConnector(limit=limit, limit_per_host=limit, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    try:
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:

            async def one(turn, t0: float) -> RequestResult:
                return await send(http, endpoint, turn, t0)

            def tick(res: RequestResult) -> None:
                bar.update(1)
                if not res.ok:
                    bar.set_postfix_str(f"failed: {res.error[:60]}", refresh=False)

            results = await drive(workload, one, arrivals, tick)
    finally:
        bar.close()
    results.sort(key=lambda r: r.request_id)
    return {
        "summary": summarize(results, slo),
        "rounds": per_round(results, slo),
        "requests": [r.as_json() for r in results],
    }


async def served_model(base_url: str, api_key: str = "", timeout: float = 10.0) -> str:
    """The first model id that GET /models lists (what to put in requests' `model`)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with (
        aiohttp.ClientSession(timeout=client_timeout) as http,
        http.get(f"{base_url.rstrip('/')}/models", headers=headers) as r,
    ):
        r.raise_for_status()
        data = (await r.json()).get("data") or []
    if not data:
        raise ValueError(f"--model: {base_url}/models lists no model; pass --model")
    return str(data[0]["id"])


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """Workload and load-shape flags (shared with bench.tiers)."""
    g = p.add_argument_group("workload")
    g.add_argument(
        "--workload", choices=("random", "multi-turn", "trace", "grounded"), default="multi-turn"
    )
    g.add_argument(
        "--num-prompts",
        type=int,
        default=32,
        help="random: prompts to send; trace: first N trace requests; grounded: tasks",
    )
    g.add_argument(
        "--input-len",
        type=int,
        default=128,
        help="words (~tokens) of a random prompt / a conversation's first question",
    )
    g.add_argument(
        "--question-len",
        type=int,
        default=0,
        help="multi-turn: words of each later question (0: --input-len)",
    )
    g.add_argument("--output-len", type=int, default=32, help="max_tokens of each request")
    g.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths drawn uniformly from [len*(1-r), len*(1+r)]",
    )
    g.add_argument("--num-clients", type=int, default=8, help="multi-turn: conversations")
    g.add_argument("--num-rounds", type=int, default=4, help="multi-turn: rounds each")
    g.add_argument(
        "--round-barrier",
        action="store_true",
        help="multi-turn: start round r+1 only when every client finished round r",
    )
    g.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="trace: Mooncake JSONL")
    g.add_argument(
        "--trace-block-len",
        type=int,
        default=16,
        help="trace: tokens of one 512-token trace block (all lengths scale alike)",
    )
    g.add_argument(
        "--trace-output-scale", type=float, default=0.1, help="trace: factor on output_length"
    )
    g.add_argument(
        "--trace-time-scale",
        type=float,
        default=0.1,
        help="trace: factor on timestamps (0.1 = ten times faster; 0 = all at once)",
    )
    g.add_argument("--max-input-len", type=int, default=0, help="trace: cap on prompt words")
    g.add_argument(
        "--grounded-json",
        action="store_true",
        help='grounded: ask for {"answer": ...} under that JSON schema (response_format)',
    )
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (inf: send when ready)",
    )
    g.add_argument(
        "--max-concurrency", type=int, default=0, help="cap on requests in flight (0: none)"
    )
    g.add_argument(
        "--duration",
        type=float,
        default=1800.0,
        help="time limit of the run, seconds (then in-flight requests are cancelled)",
    )
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--slo", default="", help="goodput limits, e.g. ttft:2000,tpot:100 (ms)")


def make_workload(a: argparse.Namespace) -> Workload:
    if a.workload == "trace":
        return TraceReplay(a.trace, block_len=a.trace_block_len, output_scale=a.trace_output_scale,
                           time_scale=a.trace_time_scale, max_requests=a.num_prompts,
                           max_input=a.max_input_len, seed=a.seed)  # fmt: skip
    if a.workload == "grounded":
        return Grounded(a.num_prompts, a.output_len, a.grounded_json, a.seed)
    if a.workload == "random":
        return MultiTurn(a.num_prompts, 1, a.input_len, a.input_len, a.output_len,
                         a.range_ratio, seed=a.seed)  # fmt: skip
    if a.num_clients < 1:
        raise ValueError("--num-clients: must be >= 1")
    if a.num_rounds < 1:
        raise ValueError("--num-rounds: must be >= 1")
    return MultiTurn(a.num_clients, a.num_rounds, a.input_len, a.question_len or a.input_len,
                     a.output_len, a.range_ratio, a.round_barrier, a.seed)  # fmt: skip


def make_arrivals(a: argparse.Namespace) -> Arrivals:
    return Arrivals(a.request_rate, a.max_concurrency, a.duration, a.seed)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.serve", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    g = p.add_argument_group("endpoint")
    g.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000/v1",
        help="the API root, ending in /v1; several, comma-separated: round robin over them",
    )
    g.add_argument("--model", default="", help="model name (default: the first of GET /models)")
    g.add_argument("--api", choices=("chat", "completions"), default="chat")
    g.add_argument("--api-key", default="", help="sent as `Authorization: Bearer KEY`")
    g.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (answers may then end before --output-len)",
    )
    add_workload_args(p)
    g = p.add_argument_group("output")
    g.add_argument("--label", default="", help="name of this run in tables and plots")
    g.add_argument("--json", type=Path, help="write summary, rounds and per-request timings")
    g.add_argument("--plot", type=Path, help="write a PNG: TTFT, throughput, TTFT per round")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


async def _main(a: argparse.Namespace) -> int:
    slo = Slo.parse(a.slo)
    workload, arrivals = make_workload(a), make_arrivals(a)
    model = a.model or await served_model(a.base_url.split(",")[0], a.api_key)
    endpoint = Endpoint(a.base_url, model, a.api, a.api_key, not a.no_ignore_eos,
                        a.request_timeout)  # fmt: skip
    started = time.time()
    run = await benchmark(endpoint, workload, arrivals, slo, not a.no_progress, a.label)
    label = a.label or f"{a.workload} @ {a.base_url}"
    print(f"\n## {label}\n\n{report.summary_table(run['summary'])}")
    if a.workload == "multi-turn" and a.round_barrier:
        print(f"\nper round:\n\n{report.rounds_table(run['rounds'])}")
    if a.json:
        meta = {"label": label, "model": model, "started": started, "args": _jsonable(a)}
        report.write_json(a.json, {"meta": meta, **run})
    if a.plot:
        report.plot({label: run}, a.plot, title=label)
    return 0 if run["summary"]["completed"] else 1


def _jsonable(a: argparse.Namespace) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) or v == math.inf else v) for k, v in vars(a).items()}


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        return event_loop.run(_main(a))
    except ValueError as e:
        print(f"bench.serve: {e}", file=sys.stderr)
        return 2
    except aiohttp.ClientError as e:
        print(f"bench.serve: cannot reach {a.base_url}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
