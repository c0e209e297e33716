"""Summaries of a run: latency statistics, throughput, goodput under an SLO, cache hit rate.

Latencies are reported in milliseconds (mean, median, p90, p99, max; percentiles by linear
interpolation, as numpy's default). Throughputs divide totals by the run's duration: from
the first request sent to the last one finished. Only successful requests count toward
latencies and tokens; failures are counted apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.client import RequestResult

SLO_KEYS = ("ttft", "tpot", "itl", "e2e")


@dataclass(frozen=True)
class Slo:
    """Per-request limits in ms; a request is "good" when it meets every limit that is set."""

    limits: tuple[tuple[str, float], ...] = ()

    @classmethod
    def parse(cls, text: str) -> Slo:
        """`ttft:500,tpot:50` -> limits; raises ValueError naming --slo."""
        limits: list[tuple[str, float]] = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition(":")
            if not sep or key not in SLO_KEYS:
                raise ValueError(f"--slo: expected KEY:MS with KEY in {SLO_KEYS}, got {part!r}")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"--slo: {key} needs a number of ms, got {value!r}") from None
            if ms <= 0:
                raise ValueError(f"--slo: {key} must be > 0 ms")
            limits.append((key, ms))
        return cls(tuple(limits))

    def good(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        for key, ms in self.limits:
            if key == "ttft":
                value: float | None = r.ttft
            elif key == "tpot":
                value = r.tpot
            elif key == "itl":
                value = max(r.itl) if r.itl else None
            else:
                value = r.e2e
            if value is not None and value * 1000 > ms:
                return False
        return True

    def __str__(self) -> str:
        return ",".join(f"{k}:{v:g}" for k, v in self.limits)


def stats_ms(values: list[float]) -> dict[str, float]:
    """mean/median/p90/p99/max of seconds, in ms; zeros for an empty list."""
    if not values:
        return dict.fromkeys(("mean", "median", "p90", "p99", "max"), 0.0)
    a = np.asarray(values, dtype=np.float64) * 1000
    return {
        "mean": float(a.mean()), "median": float(np.median(a)),
        "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)),
        "max": float(a.max()),
    }  # fmt: skip


def summarize(results: list[RequestResult], slo: Slo | None = None) -> dict[str, Any]:
    """The summary of a set of requests: counts, latency stats, throughputs, hit rate."""
    ok = [r for r in results if r.ok]
    if results:
        begin = min(r.start for r in results)
        duration = max(r.start + r.e2e for r in results) - begin
    else:
        duration = 0.0
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    output = sum(r.completion_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    out: dict[str, Any] = {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": duration, "prompt_tokens": prompt, "cached_tokens": cached,
        "completion_tokens": output,
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "request_throughput": per_s(len(ok)),
        "input_throughput": per_s(prompt), "output_throughput": per_s(output),
        "total_throughput": per_s(prompt + output),
        "ttft_ms": stats_ms([r.ttft for r in ok]),
        "tpot_ms": stats_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": stats_ms([x for r in ok for x in r.itl]),
        "e2e_ms": stats_ms([r.e2e for r in ok]),
    }  # fmt: skip
    if slo is not None and slo.limits:
        good = sum(1 for r in results if slo.good(r))
        out["slo"] = str(slo)
        out["good_requests"] = good
        out["goodput"] = per_s(good)
    errors = sorted({r.error for r in results if r.error})
    if errors:
        out["errors"] = errors[:5]
    return out


def per_round(results: list[RequestResult], slo: Slo | None = None) -> list[dict[str, Any]]:
    """`summarize` of each round's requests (round = conversation turn), in round order."""
    rounds = sorted({r.round for r in results})
    return [{"round": n, **summarize([r for r in results if r.round == n], slo)} for n in rounds]
