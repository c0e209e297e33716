"""Which workers serve a request: KV-aware prefill choice, load-aware decode choice.

The formulas (docs/routing.md has the reasoning and the flags):

    decode cost   D(w) = running(w) + decode_kv_weight * kv_usage(w)
                  over decode and `both` workers with room for the prompt's pages
                  (all of them when none has room: the worker queues it)

    prefill cost  P(w) = prefill_page_weight * (new_pages(w) + queued_pages(w))
                       + pool_page_weight * pool_pages(w)
                       + running_weight * running(w)
      new_pages(w)    = ceil((prompt_len - covered(w) * page_size) / page_size), >= 1
      covered(w)      = leading prompt pages held by w (device/host) or by the pool
      pool_pages(w)   = covered(w) - local(w): pages w must read from the pool
      queued_pages(w) = prompt tokens queued at w / page_size

A plan is a decode worker d plus who prefills; its cost is D(d) plus the prefill's P:

    P(d) itself   when no prefill worker is live, or d's uncached part
                  (prompt_len - covered(d) * page_size) is at most `disagg_threshold`
                  tokens (conditional disaggregation), or d is a `both` worker no
                  dearer than the best prefill worker (or is that worker)
    P(p*)         otherwise, p* = the prefill or `both` worker of least P

The cheapest plan wins, so a decode worker that holds the prompt's prefix attracts the
request when that makes its own prefill short.

Ties are broken at random (a seeded `random.Random` in tests). Pure Python.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.router.routing.kv_index import PrefixMatch
from services.router.routing.workers import Worker

_EPS = 1e-9


@dataclass(frozen=True)
class PolicyConfig:
    """Weights of the cost formulas; see the module docstring."""

    prefill_page_weight: float = 1.0
    pool_page_weight: float = 0.1
    running_weight: float = 1.0
    decode_kv_weight: float = 4.0
    disagg_threshold: int = 128


@dataclass(frozen=True)
class Route:
    """The choice for one request. `prefill` is "" when the decode worker prefills."""

    decode: str
    prefill: str
    cached_pages: int  # leading prompt pages the prefilling worker need not compute
    reason: str  # "disaggregated", "below_threshold", "no_prefill_worker", "self_prefill"


def decode_cost(w: Worker, cfg: PolicyConfig) -> float:
    return w.running + cfg.decode_kv_weight * w.kv_usage


def prefill_cost(
    w: Worker, prompt_len: int, page_size: int, match: PrefixMatch, cfg: PolicyConfig
) -> float:
    covered = match.covered.get(w.id, 0)
    local = match.local.get(w.id, 0)
    new_pages = max(1, math.ceil((prompt_len - covered * page_size) / page_size))
    queued = w.queued_prefill_tokens / page_size
    return (
        cfg.prefill_page_weight * (new_pages + queued)
        + cfg.pool_page_weight * (covered - local)
        + cfg.running_weight * w.running
    )


def choose(
    prompt_len: int,
    page_size: int,
    match: PrefixMatch,
    decodes: Sequence[Worker],
    prefills: Sequence[Worker],
    cfg: PolicyConfig,
    *,
    rng: random.Random,
) -> Route | None:
    """Pick a decode worker and (maybe) a prefill worker; None when no decode worker."""
    if not decodes:
        return None
    need = math.ceil((prompt_len + 1) / page_size)
    roomy = [w for w in decodes if w.report.free_pages >= need] or list(decodes)
    p_cost = {w.id: prefill_cost(w, prompt_len, page_size, match, cfg) for w in prefills}
    best_p = _cheapest(prefills, lambda w: p_cost[w.id], rng) if prefills else None
    plans: dict[str, tuple[float, Route]] = {}
    for d in roomy:
        covered = match.covered.get(d.id, 0)
        own = prefill_cost(d, prompt_len, page_size, match, cfg)
        if best_p is None:
            plan = own, Route(d.id, "", covered, "no_prefill_worker")
        elif prompt_len - covered * page_size <= cfg.disagg_threshold:
            plan = own, Route(d.id, "", covered, "below_threshold")
        elif d.role == "both" and (best_p.id == d.id or own <= p_cost[best_p.id]):
            plan = own, Route(d.id, "", covered, "self_prefill")
        else:
            cached = match.covered.get(best_p.id, 0)
            plan = p_cost[best_p.id], Route(d.id, best_p.id, cached, "disaggregated")
        plans[d.id] = (decode_cost(d, cfg) + plan[0], plan[1])
    chosen = _cheapest(roomy, lambda w: plans[w.id][0], rng)
    return plans[chosen.id][1]


def _cheapest(
    workers: Sequence[Worker], cost: Callable[[Worker], float], rng: random.Random
) -> Worker:
    costs = [(cost(w), w) for w in workers]
    best = min(c for c, _ in costs)
    return rng.choice([w for c, w in costs if c <= best + _EPS])
