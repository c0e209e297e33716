"""llama.cpp as bench.engine's peer: llama-bench and llama-server from `make bench-peers`.

Measured in the same run as our engine, on the same GGUF, with the same thread count:
- `llama-bench -m GGUF -p 512,P -n N -t T -r 3 -o json`: pp512, ppP (P: the bench's
  --prefill-tokens, 2048 by default) and tgN (N: --new-tokens, 128 by default);
- `llama-server --parallel S` (S: --streams), a context of S x (prompt + new + 32) tokens,
  no prompt cache; S requests to /completion at once, each a token-id prompt (the ids our
  engine gets, so no BOS is added on either side), `n_predict` N and `ignore_eos`; output
  tokens/s over the wall time from the first request sent to the last reply.
Ratios ours/llama.cpp and one verdict per goal of issue 24 (GOALS). A peer that is not
built, or fails, leaves figures absent with the reason, never a crash of the bench.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path

import aiohttp

from bench.deployments import PeerServer

DEFAULT_DIR = Path(__file__).resolve().parents[1] / ".peers" / "llama.cpp"
BINARIES = ("llama-bench", "llama-server")
# Issue 24's goals: ours / llama.cpp at least this.
GOALS = {"single_stream_vs_tg": 1.0, "prefill_vs_pp": 2.0, "streams_vs_llama_server": 2.0}


def missing(folder: Path | None, binaries: tuple[str, ...] = BINARIES) -> str:
    """ "" when the binaries (both by default) are in FOLDER/bin, else why the peer cannot
    run."""
    if folder is None:
        return "disabled (--peer-llama-cpp none)"
    absent = [b for b in binaries if not (folder / "bin" / b).is_file()]
    if absent:
        return f"not built: no {', '.join(absent)} in {folder / 'bin'} (make bench-peers)"
    return ""


def build_info(folder: Path) -> dict:
    """What `make bench-peers` recorded (version, cmake options), or {}."""
    try:
        return json.loads((folder / "build.json").read_text())
    except (OSError, ValueError):
        return {}


def parse_llama_bench(stdout: str) -> dict:
    """llama-bench's `-o json` list -> {"pp512": {...}, "tg128": {...}}, one entry per test.

    A test with n_gen 0 is a prefill (ppN), with n_prompt 0 a generation (tgN); others
    (pp+tg combined) are named ppN+tgM. Figures are llama-bench's mean and stddev of tok/s."""
    out = {}
    for run in json.loads(stdout):
        p, g = run["n_prompt"], run["n_gen"]
        name = f"pp{p}" if g == 0 else f"tg{g}" if p == 0 else f"pp{p}+tg{g}"
        out[name] = {"tok_s": round(run["avg_ts"], 2), "stddev_tok_s": round(run["stddev_ts"], 2),
                     "threads": run["n_threads"], "type": run.get("model_type", "")}  # fmt: skip
    return out


def run_llama_bench(folder: Path, model: Path, threads: int, prompts: list[int], gen: int,
                    *, repetitions: int = 3, timeout: float = 600.0) -> dict:  # fmt: skip
    cmd = [str(folder / "bin" / "llama-bench"), "-m", str(model),
           "-p", ",".join(map(str, prompts)), "-n", str(gen), "-t", str(threads),
           "-r", str(repetitions), "-o", "json"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                         stdin=subprocess.DEVNULL)  # fmt: skip
    if run.returncode != 0:
        raise RuntimeError(f"llama-bench exited {run.returncode}: {run.stderr.strip()[-500:]}")
    return parse_llama_bench(run.stdout)


async def _complete(http: aiohttp.ClientSession, url: str, ids: list[int], n: int) -> int:
    body = {"prompt": ids, "n_predict": n, "ignore_eos": True, "temperature": 0,
            "cache_prompt": False, "stream": False}  # fmt: skip
    async with http.post(f"{url}/completion", json=body) as r:
        r.raise_for_status()
        return (await r.json())["tokens_predicted"]


async def _streams(url: str, prompts: list[list[int]], n: int, timeout: float) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        await asyncio.gather(*(_complete(http, url, ids, 2) for ids in prompts))  # warm-up
        start = time.perf_counter()
        produced = await asyncio.gather(*(_complete(http, url, ids, n) for ids in prompts))
        end = time.perf_counter()
    total = sum(produced)
    return {"streams": len(prompts), "output_tokens": total, "seconds": round(end - start, 3),
            "tok_s": round(total / (end - start), 2)}  # fmt: skip


def run_llama_server(
    folder: Path,
    model: Path,
    threads: int,
    prompts: list[list[int]],
    new_tokens: int,
    workdir: Path,
    *,
    timeout: float = 600.0,
) -> dict:
    ctx = len(prompts) * (max(map(len, prompts)) + new_tokens + 32)
    server = PeerServer("llama-server", str(folder / "bin" / "llama-server"), model, workdir,
                        threads, parallel=len(prompts), ctx=ctx)  # fmt: skip

    async def go() -> dict:
        try:
            await server.start(timeout=120)
            base = server.url.removesuffix("/v1")
            return await asyncio.wait_for(_streams(base, prompts, new_tokens, timeout), timeout)
        finally:
            server.stop()

    result = asyncio.run(go())
    result["parallel"], result["ctx"] = len(prompts), ctx
    return result


def ratios(ours_one: float, ours_prefill: float, ours_streams: float, peer: dict,
           *, tg: str, pp: str, streams: str) -> dict:  # fmt: skip
    """Ours / llama.cpp for the three goals, with a verdict each; a figure the peer lacks
    leaves its ratio None and its verdict out."""
    bench = peer.get("llama_bench", {})
    pairs = (
        (f"single_stream_vs_{tg}", ours_one, bench.get(tg), GOALS["single_stream_vs_tg"]),
        (f"prefill_vs_{pp}", ours_prefill, bench.get(pp), GOALS["prefill_vs_pp"]),
        (f"{streams}_vs_llama_server", ours_streams, peer.get("llama_server"),
         GOALS["streams_vs_llama_server"]),
    )  # fmt: skip
    out: dict = {"ratios": {}, "verdicts": {}}
    for name, ours, theirs, goal in pairs:
        if not theirs or not theirs.get("tok_s"):
            out["ratios"][name] = None
            continue
        ratio = round(ours / theirs["tok_s"], 3)
        out["ratios"][name] = ratio
        out["verdicts"][f"{name}_{goal}x"] = ratio >= goal
    return out


def measure(folder: Path | None, model: Path, threads: int, *, prefill_tokens: int,
            new_tokens: int, stream_prompts: list[list[int]], workdir: Path) -> dict:  # fmt: skip
    """The `llama_cpp` section of bench.engine's report, before the ratios."""
    why = missing(folder)
    if why:
        return {"absent": why}
    if model.suffix != ".gguf":
        return {"absent": f"llama.cpp reads GGUF files; the model is {model}"}
    section: dict = {"dir": str(folder), "threads": threads, "model": str(model),
                     "build": build_info(folder)}  # fmt: skip
    try:
        prompts = sorted({512, prefill_tokens})
        section["llama_bench"] = run_llama_bench(folder, model, threads, prompts, new_tokens)
    except (RuntimeError, OSError, ValueError, KeyError, subprocess.TimeoutExpired) as e:
        section["llama_bench_error"] = str(e)
    try:
        section["llama_server"] = run_llama_server(folder, model, threads, stream_prompts,
                                                   new_tokens, workdir)  # fmt: skip
    except (RuntimeError, OSError, ValueError, KeyError, TimeoutError, aiohttp.ClientError) as e:
        section["llama_server_error"] = f"{type(e).__name__}: {e} (log: {workdir / 'peer.log'})"
    return section
