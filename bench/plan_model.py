"""One worker's throughput measured on the real engine, for bench.plan and the planner.

Prefill: tokens per second computing one prompt of `--prefill-tokens`. Decode: the time of
one step at several batch sizes, fitted as `step = base + per_seq * batch` (least
squares). The result is cached as JSON (bench/results/plan_capacity.json by default) so a
simulation reruns without the model; `--measure` measures again.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from bench.engine_measure import token_prompts
from services.planner.policy import Capacity

DEFAULT_CACHE = Path(__file__).resolve().parent / "results" / "plan_capacity.json"
BATCHES = (1, 4, 8, 16)


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through `points` (slope >= 0)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in points) / sxx) if sxx else 0.0
    return my - slope * mx, slope


def _decode_step_s(core, params_cls, batch: int, steps: int) -> float:
    vocab = core.model.config.vocab_size
    params = params_cls(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for i, ids in enumerate(token_prompts(batch, 16, vocab)):
        core.add(f"d{batch}-{i}-{time.perf_counter()}", ids, params)
    produced = 0
    while produced < batch:  # every prompt prefilled, its first token out
        produced += len(core.step())
    start, taken = time.perf_counter(), 0
    while core.has_work():
        core.step()
        taken += 1
    return (time.perf_counter() - start) / max(1, taken)


def measure(threads: int, prefill_tokens: int, seats: int) -> dict:
    """Load the default model with `threads` threads and time prefill and decode steps."""
    import torch

    from libs.common.engine.config import EngineConfig
    from libs.common.engine.core.sampling_params import SamplingParams
    from libs.common.engine.step_loop import EngineCore

    torch.set_num_threads(threads)
    core = EngineCore(EngineConfig(model="default", num_threads=threads,
                                   max_num_batched_tokens=max(2048, prefill_tokens),
                                   max_num_seqs=max(BATCHES), kv_cache_mb=256,
                                   enable_prefix_cache=False))  # fmt: skip
    vocab = core.model.config.vocab_size
    prompt = token_prompts(1, prefill_tokens, vocab)[0]
    _decode_step_s(core, SamplingParams, 1, 4)  # warm up
    params = SamplingParams(max_tokens=1, temperature=0)
    core.add("warm", prompt, params)
    while core.has_work():
        core.step()
    start = time.perf_counter()
    core.add("prefill", prompt, params)
    while core.has_work():
        core.step()
    prefill_s = time.perf_counter() - start
    points = [(b, _decode_step_s(core, SamplingParams, b, 16)) for b in BATCHES]
    base, per_seq = fit_line(points)
    return {
        "prefill_tokens_per_s": round(prefill_tokens / prefill_s, 1),
        "decode_step_base_s": round(max(base, 1e-4), 5),
        "decode_step_per_seq_s": round(per_seq, 6),
        "decode_seats": seats,
        "decode_step_s_by_batch": {str(b): round(s, 5) for b, s in points},
        "threads": threads,
        "prefill_tokens": prefill_tokens,
        "measured_at": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
        "loadavg": os.getloadavg()[0],
    }


def load_or_measure(path: Path, remeasure: bool, threads: int, seats: int) -> dict:
    if path.exists() and not remeasure:
        return json.loads(path.read_text())
    measured = measure(threads, prefill_tokens=512, seats=seats)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(measured, indent=1) + "\n")
    return measured


def capacity_of(measured: dict) -> Capacity:
    keys = ("prefill_tokens_per_s", "decode_step_base_s", "decode_step_per_seq_s", "decode_seats")
    return Capacity(**{k: measured[k] for k in keys})
