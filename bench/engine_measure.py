"""What bench.engine measures on its own: the machine's bounds, and our engine's greedy runs.

Shared by the default run (bench/engine.py) and the synthetic ~1B model's run
(bench/engine_1b.py).
"""

from __future__ import annotations

import time


def token_prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    # Deterministic, varied ids away from the special tokens at the start of the vocab.
    return [
        [100 + (i * 7919 + j * 104729) % (vocab - 200) for j in range(length)] for i in range(n)
    ]


def measure_copy_bandwidth(torch) -> float:
    src = torch.randn(64 * 2**20)  # 256 MiB: far past the caches
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return src.numel() * 4 / best


def measure_read_bandwidth(torch) -> float:
    """Bytes of a large fp32 tensor read per second (a sum: reads, no writes).

    A copy moves each byte twice (read and write), so the copy figure the
    issue's single-stream bound is defined by can be beaten by a decode step
    that only reads its weights; this one is the tighter floor."""
    src = torch.randn(64 * 2**20)
    src.sum()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - start)
    return src.numel() * 4 / best


def measure_matmul_rate(torch, n: int = 2048) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def measure_onednn_rate(torch, n: int = 2048) -> float:
    """The same product through the engine's Linear (oneDNN weights on the CPU)."""
    from libs.common.engine.model.linear import Linear

    x, lin = torch.randn(n, n), Linear(torch.randn(n, n))
    lin(x)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        lin(x)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def run_ours(core, prompts, new_tokens, params_cls) -> dict:
    params = params_cls(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        core.add(f"b{i}-{start}", ids, params)
    produced, first_all = 0, None
    while core.has_work():
        produced += len(core.step())
        if first_all is None and produced >= len(prompts):
            first_all, at_first = time.perf_counter(), produced
    end = time.perf_counter()
    decode_tokens = produced - at_first
    return {
        "output_tokens": produced,
        "seconds": round(end - start, 3),
        "tok_s": round(produced / (end - start), 2),
        "decode_tok_s": round(decode_tokens / max(end - first_all, 1e-9), 2),
    }


# Builds of our quantized kernels bench.engine's --kernels can force (TANDEM_KERNELS):
# libs/common/engine/model/quant/native.py's VARIANTS.
KERNEL_VARIANTS = ("avx512vnni", "avx512", "avx2", "generic")


def kernels_used(asked: str) -> dict:
    """Which build of the quantized kernels this process runs, and the one --kernels asked
    for; `kernels_forced_ignored` when TANDEM_KERNELS named another build than the one
    loaded (a checkout whose kernels do not read it)."""
    from libs.common.engine.model.quant.native import library

    _, variant = library()
    out = {"kernels": variant, "kernels_asked": asked}
    if asked != "auto" and asked != variant:
        out["kernels_forced_ignored"] = True
    return out
