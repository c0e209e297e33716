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

Conditional disaggregation: when the decode worker's own uncached part
(prompt_len - covered(d) * page_size) is at most `disagg_threshold` tokens, or no
prefill worker is live, the decode worker prefills itself. A `both` worker chosen for
decode also competes for its own prefill, and wins it when cheapest.

Ties are broken at random (a seeded `random.Random` in tests). Pure Python.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.router.kv_index import PrefixMatch
from services.router.workers import Worker

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
    rng: random.Random,
) -> Route | None:
    """Pick a decode worker and (maybe) a prefill worker; None when no decode worker."""
    if not decodes:
        return None
    need = math.ceil((prompt_len + 1) / page_size)
    roomy = [w for w in decodes if w.report.free_pages >= need] or list(decodes)
    d = _cheapest(roomy, lambda w: decode_cost(w, cfg), rng)
    self_covered = match.covered.get(d.id, 0)
    uncached = prompt_len - self_covered * page_size
    if not prefills and d.role != "both":
        return Route(d.id, "", self_covered, "no_prefill_worker")
    if uncached <= cfg.disagg_threshold:
        return Route(d.id, "", self_covered, "below_threshold")
    candidates = [*prefills, d] if d.role == "both" else list(prefills)
    p = _cheapest(candidates, lambda w: prefill_cost(w, prompt_len, page_size, match, cfg), rng)
    if p.id == d.id:
        return Route(d.id, "", self_covered, "self_prefill")
    return Route(d.id, p.id, match.covered.get(p.id, 0), "disaggregated")


def _cheapest(
    workers: Sequence[Worker], cost: Callable[[Worker], float], rng: random.Random
) -> Worker:
    costs = [(cost(w), w) for w in workers]
    best = min(c for c, _ in costs)
    return rng.choice([w for c, w in costs if c <= best + _EPS])
