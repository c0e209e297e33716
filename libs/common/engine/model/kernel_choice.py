"""Which product multiplies each quantized weight, per row-count class, chosen at start-up.

`choose_kernels(model, mode, copy_mb)` (EngineCore, `--kernel-choice`): for each distinct
(format, shape) of the model's QuantLinears and each row class of 5+ rows
(linear.ROW_CLASSES), the candidate paths (QuantLinear.candidates: the native kernels,
the dequantized slices through oneDNN, a oneDNN product on an fp32 copy of the weight) are
timed on one sample of x, interleaved, min over rounds (ROUNDS) (a path that beat the native
one: timed twice, its slower showing kept), and the fastest is taken only when it takes at
most MARGIN of the native path's time: noise on shared cores must not
flip a choice, and the native path needs no memory. 1-4 rows always run tq_gemv.

The choice is per class, never per call: every row of a class goes through one path, so a
row's bits do not depend on the rows beside it (a chunked prefill equals an unchunked one
as far as the path itself is batch-invariant). fp32 copies cost memory (4 bytes a value
against 0.5-1 for the blocks), so they are granted within `copy_mb`, the shapes that gain
most per byte first; a shape whose copy does not fit keeps its best path without one.

Measurements are cached for the process by (kernel build, threads, format, shape): a second
EngineCore over the same model re-applies them at no cost. Each product is timed on at
most SAMPLE_OUT output rows of its weight (the time of a product is linear in them), so
the whole measurement is bounded whatever the model's size.
"""

from __future__ import annotations

import threading
import time

import structlog
import torch

from libs.common.engine.load.quantized import QuantWeight
from libs.common.engine.model.linear import ROW_CLASSES, QuantLinear, SplitLinear
from libs.common.engine.model.quant.native import library

log = structlog.get_logger(__name__)

MARGIN = 0.9  # another path must take at most 90% of the native path's time
SAMPLE_ROWS = (1, 32, 256)  # rows of x timed per class (class 0 is not timed)
SAMPLE_OUT = 1024  # output rows of the weight timed at most
ROUNDS = (3, 20)  # timed rounds per class: at least, at most
CLASS_SECONDS = 0.03  # time spent per class and shape before stopping at ROUNDS[0]

Key = tuple[str, int, int]  # format, out_features, in_features
_measured: dict[tuple, list[dict[str, float]]] = {}
_lock = threading.Lock()


def quant_linears(model) -> list[QuantLinear]:
    """Every QuantLinear of a LlamaModel (fused parts of a SplitLinear included)."""
    found: list = [model.lm_head]
    for layer in model.layers:
        mlp = layer.mlp
        found += [layer.qkv, layer.o]
        mlps = [mlp] if hasattr(mlp, "gate_up") else mlp.experts
        found += [p for m in mlps for p in (m.gate_up, m.down)]
        if not hasattr(mlp, "gate_up"):
            found.append(mlp.router)
    flat: list = []
    for linear in found:
        flat += linear._parts if isinstance(linear, SplitLinear) else [linear]
    return [x for x in flat if isinstance(x, QuantLinear)]


def key_of(linear: QuantLinear) -> Key:
    return (linear.weight.kind, linear.out_features, linear.in_features)


def measure(linear: QuantLinear) -> list[dict[str, float]]:
    """Seconds per product of each candidate path, per row class (min over rounds; the
    native path alone, untimed, for 1-4 rows); cached for the process."""
    cache_key = (library()[1], torch.get_num_threads(), *key_of(linear))
    with _lock:
        if cache_key in _measured:
            return _measured[cache_key]
    w = linear.weight
    sample = QuantLinear(QuantWeight(w.kind, w.data[:SAMPLE_OUT], w.cols))
    copy = sample.make_copy() if "copy" in sample.candidates(1) else None
    gen = torch.Generator().manual_seed(0)
    times: list[dict[str, float]] = [{sample.native_paths[0]: 0.0}]
    for cls in range(1, len(ROW_CLASSES)):
        x = torch.randn(SAMPLE_ROWS[cls], w.cols, generator=gen)
        paths = sample.candidates(cls)
        best = _timed(sample, x, paths, copy)
        # A path that beat the native one is timed again beside it and keeps the slower of
        # its two showings (the native path the faster of its): a burst of load in one
        # pass must not make the choice.
        contenders = [p for p in paths[1:] if best[p] <= MARGIN * best[paths[0]]]
        if contenders:
            again = _timed(sample, x, [paths[0], *contenders], copy)
            best[paths[0]] = min(best[paths[0]], again[paths[0]])
            best.update({p: max(best[p], again[p]) for p in contenders})
        times.append(best)
    with _lock:
        _measured[cache_key] = times
    return times


def _timed(sample: QuantLinear, x: torch.Tensor, paths: list[str], copy) -> dict[str, float]:
    """Seconds per product of each path on x, min over rounds. The first round warms
    caches and oneDNN; then rounds (every path once, interleaved, so a burst of load hits
    them alike) until ROUNDS[0] are timed and CLASS_SECONDS spent, or ROUNDS[1]."""
    best = dict.fromkeys(paths, float("inf"))
    began, rounds = time.perf_counter(), 0
    while rounds <= ROUNDS[0] or (
        rounds <= ROUNDS[1] and time.perf_counter() - began < CLASS_SECONDS
    ):
        for path in paths:
            start = time.perf_counter()
            sample.product(path, x, copy)
            if rounds:
                best[path] = min(best[path], time.perf_counter() - start)
        rounds += 1
    return best


def pick(times: list[dict[str, float]], allow_copy: bool) -> tuple[str, ...]:
    """Per class: the fastest path if it beats the native one (the first) by MARGIN."""
    chosen = []
    for per_path in times:
        native = next(iter(per_path))
        allowed = {p: t for p, t in per_path.items() if allow_copy or p != "copy"}
        fastest = min(allowed, key=allowed.__getitem__)
        good = allowed[fastest] <= MARGIN * per_path[native]
        chosen.append(fastest if good else native)
    return tuple(chosen)


def _gain(times: list[dict[str, float]], paths: tuple[str, ...]) -> float:
    """Sum over classes of the fraction of the native path's time a choice saves."""
    total = 0.0
    for per_path, path in zip(times[1:], paths[1:], strict=True):
        native = next(iter(per_path))
        total += 1.0 - per_path[path] / per_path[native]
    return total


def choose_kernels(model, mode: str = "measure", copy_mb: int = 0) -> dict[Key, tuple]:
    """Route each QuantLinear's row classes through the chosen paths; returns the table
    (format, out, in) -> path per class. "native": the built-in paths, nothing timed."""
    if mode not in ("measure", "native"):  # EngineConfig.kernel_choice (KERNEL_CHOICES)
        raise ValueError(f"kernel_choice must be measure or native, got {mode!r}")
    groups: dict[Key, list[QuantLinear]] = {}
    for linear in quant_linears(model):
        groups.setdefault(key_of(linear), []).append(linear)
    if mode == "native" or not groups:
        for group in groups.values():
            for linear in group:
                linear.use(linear.native_paths)
        return {key: group[0].native_paths for key, group in groups.items()}
    began = time.perf_counter()
    times = {key: measure(group[0]) for key, group in groups.items()}
    table = {key: pick(t, allow_copy=False) for key, t in times.items()}
    offers = {key: pick(t, allow_copy=True) for key, t in times.items()}
    offers = {key: paths for key, paths in offers.items() if "copy" in paths}
    budget = copy_mb << 20
    by_value = sorted(offers, key=lambda k: -_gain(times[k], offers[k]) / _copy_bytes(groups[k]))
    for key in by_value:
        if _copy_bytes(groups[key]) <= budget:
            budget -= _copy_bytes(groups[key])
            table[key] = offers[key]
    for key, paths in table.items():
        for linear in groups[key]:
            linear.use(paths)
        for cls, path in enumerate(paths):
            spent = {p: round(t * 1e3, 3) for p, t in times[key][cls].items() if cls}
            log.info("quant.choice", format=key[0], shape=key[1:], rows=ROW_CLASSES[cls],
                     candidates_ms=spent, chosen=path, weights=len(groups[key]))  # fmt: skip
    used = (copy_mb << 20) - budget
    log.info("quant.choice_done", seconds=round(time.perf_counter() - began, 3),
             copies_mb=round(used / 2**20, 1), copy_budget_mb=copy_mb)  # fmt: skip
    return table


def _copy_bytes(group: list[QuantLinear]) -> int:
    return sum(4 * q.out_features * q.in_features for q in group)
