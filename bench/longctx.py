"""Long-context decode through the HTTP API: Tandem against llama-server on one long prompt.

    python -m bench.longctx --json                  # ~5,500-token prompt, 64 tokens out
    python -m bench.longctx --json --kv-dtype bf16  # our workers' KV in bf16

One system after the other, on the same machine and the same default model:
- Tandem: a Deployment of one prefill and one decode worker (router `--disagg-threshold 0`,
  so the prompt is prefilled on one and decoded on the other; the two phases of one request
  do not overlap, so each worker gets `--threads`), prefix cache and pool off.
- llama-server (`make bench-peers` builds it) on the default model's GGUF, `--threads`
  threads, one slot with a context that holds the prompt and the answer, `cache_prompt`
  off; absent (with the reason) when it is not built.
Each gets one short warm-up request, then `--requests` streamed `/v1/completions` of the
long prompt, one at a time, greedy, `ignore_eos` (both servers take it), `--max-tokens`
each. Every long prompt starts with its own first line, so no prefix cache on either side
can make a later request cheaper. The prompt is numbered sections of sentences drawn from
word lists with a fixed seed, at least `--prompt-tokens` by the default model's tokenizer.

Per request: TTFT, decode tok/s = (tokens - 1) / (last token's time - first token's time),
tokens (the server's usage count; chunks with text as well). Per system: medians. Then
`ratios` (ours / llama-server's decode tok/s; `ttft_speedup` = llama-server's TTFT / ours)
and `verdicts`: the goal is decode at least 1.0x llama-server's.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from bench.client import Endpoint, RequestResult, send
from bench.deployments import Deployment, PeerServer, Topology
from bench.report import emit
from bench.serve import served_model
from bench.workloads import Turn
from libs.common import event_loop
from scripts.cluster import REPO

LLAMA_SERVER = REPO / ".peers" / "llama.cpp" / "bin" / "llama-server"
GOAL_DECODE_RATIO = 1.0

SUBJECTS = (
    "The harbour master",
    "A young botanist",
    "The night ferry",
    "Our old neighbour",
    "The survey team",
    "A travelling baker",
    "The village council",
    "The lighthouse",
    "A retired engineer",
    "The school choir",
    "The river pilot",
    "A quiet librarian",
)
VERBS = ("repaired", "described", "measured", "painted", "carried", "counted", "questioned",
         "followed", "planted", "recorded", "mended", "watched")  # fmt: skip
OBJECTS = (
    "the broken weather vane",
    "three crates of lemons",
    "a map of the northern coast",
    "the tide tables",
    "a basket of wild garlic",
    "the bell in the square",
    "an unfinished letter",
    "the rows of apple trees",
    "a pair of brass compasses",
    "the ledger of ship arrivals",
    "a sketch of the old mill",
    "the winter stores",
)
PLACES = ("near the east pier", "behind the market hall", "on the hill above the town",
          "beside the canal locks", "in the reading room", "at the edge of the salt marsh",
          "under the railway bridge", "by the orchard wall")  # fmt: skip
TIMES = ("before sunrise", "after the storm", "during the autumn fair", "late on a Sunday",
         "while the fog lifted", "at the turn of the tide", "the following spring",
         "as the lamps were lit")  # fmt: skip


def sentence(rng: random.Random) -> str:
    return (f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} "
            f"{rng.choice(PLACES)} {rng.choice(TIMES)}.")  # fmt: skip


def build_prompt(tag: str, target: int, count: Callable[[str], int], seed: int = 0) -> str:
    """At least `target` tokens (by `count`) of numbered sections, first line naming `tag`:
    prompts of different tags differ from their first tokens on, the rest is the same."""
    rng = random.Random(seed)
    parts = [f"Field notes, copy {tag}: what the town saw, section by section.\n"]
    chars, section = len(parts[0]), 0
    while True:
        section += 1
        text = f"\nSection {section}. " + " ".join(sentence(rng) for _ in range(5)) + "\n"
        parts.append(text)
        chars += len(text)
        # Tokenize only once the text may be long enough (about 5 characters a token here).
        if chars >= 4 * target and count("".join(parts)) >= target:
            return "".join(parts) + f"\nSection {section + 1}. "


def decode_rate(tokens: int, first: float, last: float) -> float | None:
    """Tokens per second after the first: (tokens - 1) / (last - first); None without a
    second token or a span of time."""
    if tokens < 2 or last <= first:
        return None
    return (tokens - 1) / (last - first)


def request_figures(res: RequestResult) -> dict[str, Any]:
    """One long request: TTFT, decode rate, tokens (usage count, and text chunks)."""
    chunks = len(res.itl) + (1 if res.ttft else 0)
    span = sum(res.itl)
    rate = decode_rate(res.completion_tokens, res.ttft, res.ttft + span) if res.ok else None
    return {"ok": res.ok, "error": res.error, "ttft_s": round(res.ttft, 4),
            "decode_tok_s": None if rate is None else round(rate, 3),
            "decode_s": round(span, 4), "tokens": res.completion_tokens, "chunks": chunks,
            "prompt_tokens": res.prompt_tokens, "cached_tokens": res.cached_tokens}  # fmt: skip


def medians(requests: list[dict[str, Any]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key in ("ttft_s", "decode_tok_s"):
        values = [r[key] for r in requests if r["ok"] and r[key] is not None]
        out[key] = round(statistics.median(values), 4) if values else None
    return out


def compare(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """Ratios of the medians (None where either is missing) and the goal's verdict."""
    a, b = ours.get("median") or {}, theirs.get("median") or {}
    decode = _ratio(a.get("decode_tok_s"), b.get("decode_tok_s"))
    ratios = {"decode": decode, "ttft_speedup": _ratio(b.get("ttft_s"), a.get("ttft_s"))}
    verdict = None if decode is None else decode >= GOAL_DECODE_RATIO
    return {"ratios": ratios, "verdicts": {"decode_at_least_1.0x_llama_server": verdict}}


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 3) if num and den else None


def tandem(a: argparse.Namespace, workdir: Path) -> Deployment:
    flags = ["--num-threads", str(a.threads), "--transport", "tcp", "--kv-dtype", a.kv_dtype,
             "--kv-cache-mb", str(a.kv_cache_mb), "--no-prefix-cache", "true",
             "--no-pool", "true"]  # fmt: skip
    topo = Topology("longctx", 1, 1, flags, router_args=["--disagg-threshold", "0"],
                    note="1 prefill + 1 decode, no prefix cache, no pool")  # fmt: skip
    return Deployment(topo, workdir)


def llama_server(a: argparse.Namespace, workdir: Path, model: Path) -> PeerServer:
    # One slot whose context holds the prompt (its tokenizer may count a few more) + answer.
    ctx = max(4096, a.prompt_tokens + a.max_tokens + 512)
    return PeerServer("llama-server", str(a.llama_server), model, workdir, a.threads, ctx=ctx)


async def measure(system: Deployment | PeerServer, a: argparse.Namespace,
                  prompts: list[str], extra: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """Start `system`, warm it up, send each prompt alone in turn, stop it."""
    try:
        await system.start(a.ready_timeout)
        model = getattr(system, "model_name", "") or await served_model(system.url)
        ep = Endpoint(system.url, model, api="completions", timeout=a.request_timeout,
                      extra=extra)  # fmt: skip
        results = []
        # A connection per request: llama-server closes one after a streamed answer, and a
        # reused one fails with "Can not write request body".
        conn = aiohttp.TCPConnector(force_close=True)
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:
            warm = await send(http, ep, _turn(0, "Write one sentence about the sea.", 8), 0.0)
            if not warm.ok:
                return {"note": f"warm-up failed: {warm.error}"}
            for i, prompt in enumerate(prompts, 1):
                res = await send(http, ep, _turn(i, prompt, a.max_tokens), 0.0)
                results.append(request_figures(res))
                print(f"  request {i}: {results[-1]}", file=sys.stderr, flush=True)
    except (RuntimeError, TimeoutError, OSError, ValueError, aiohttp.ClientError) as e:
        return {"note": f"failed: {e}"}
    finally:
        system.stop()
    return {"requests": results, "median": medians(results)}


def _turn(i: int, text: str, max_tokens: int) -> Turn:
    return Turn(i, 0, 0, [{"role": "user", "content": text}], max_tokens)


def machine(threads: int) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": threads,
            "loadavg_start": os.getloadavg()}  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.longctx",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--threads", type=int, default=2, help="threads of each worker and peer")
    p.add_argument("--prompt-tokens", type=int, default=5500, help="long prompt, at least")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens out per request")
    p.add_argument("--requests", type=int, default=2, help="long requests per system")
    p.add_argument("--kv-dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="our workers' KV element type (llama-server's is f16)")  # fmt: skip
    p.add_argument("--kv-cache-mb", type=int, default=512, help="our workers' KV pool, MiB")
    p.add_argument("--llama-server", type=Path, default=LLAMA_SERVER, help="its binary")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--workdir", type=Path, default=REPO / "run" / "bench-longctx",
                   help="nats store and service logs")  # fmt: skip
    return p


def check(a: argparse.Namespace) -> None:
    for flag in ("threads", "prompt_tokens", "max_tokens", "requests", "kv_cache_mb"):
        if getattr(a, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}: must be >= 1")
    if a.max_tokens < 2:
        raise ValueError("--max-tokens: must be >= 2 (a decode rate needs two tokens)")


async def _main(a: argparse.Namespace) -> int:
    from libs.common.engine.load.source import default_model_path, load_tokenizer

    tokenizer, model_id, context = load_tokenizer("default")

    def count(text: str) -> int:
        return len(tokenizer.encode(text))

    prompts = [build_prompt(f"{i}", a.prompt_tokens, count) for i in range(1, a.requests + 1)]
    report: dict[str, Any] = {
        "machine": machine(a.threads),
        "config": {"model": model_id, "prompt_tokens": count(prompts[0]),
                   "max_tokens": a.max_tokens, "requests": a.requests, "kv_dtype": a.kv_dtype,
                   "threads": a.threads, "ignore_eos": True},
    }  # fmt: skip
    if report["config"]["prompt_tokens"] + a.max_tokens > context:
        raise ValueError(f"--prompt-tokens: prompt + answer over the model's {context} tokens")
    shutil.rmtree(a.workdir, ignore_errors=True)  # a router replays the nats store's events
    print("== tandem", file=sys.stderr, flush=True)
    report["tandem"] = await measure(tandem(a, a.workdir / "tandem"), a, prompts, {})
    peer = llama_server(a, a.workdir / "llama-server", Path(default_model_path()))
    why = peer.available()
    if why:
        report["llama_server"] = {"absent": why}
    else:
        print("== llama-server", file=sys.stderr, flush=True)
        report["llama_server"] = await measure(peer, a, prompts, {"cache_prompt": False})
    report.update(compare(report["tandem"], report["llama_server"]))
    report["machine"]["loadavg_end"] = os.getloadavg()
    emit(report, a.json)
    ok = report["tandem"].get("requests") and all(r["ok"] for r in report["tandem"]["requests"])
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        check(a)
        return event_loop.run(_main(a))
    except ValueError as e:
        print(f"bench.longctx: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
