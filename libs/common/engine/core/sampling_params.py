"""How one request samples its tokens; validated when built, JSON on the wire."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

# vLLM's default cap on top-n logprobs: enough for any UI, bounded work per token.
MAX_LOGPROBS = 20


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings, with vLLM's defaults and meanings.

    - temperature 0 is greedy; top_k 0 (or -1 on input) and top_p 1 and min_p 0
      disable those filters;
    - seed makes the request's samples reproducible whatever else is batched;
    - repetition_penalty (multiplicative, 1 = off) applies to prompt and output
      tokens; frequency/presence penalties (additive, 0 = off) to output tokens;
    - generation stops at max_tokens, at any of stop_token_ids, at EOS unless
      ignore_eos, or when the text ends with one of `stop` (strings, checked by
      the detokenizing side, not the scheduler);
    - logprobs: None for none, n >= 0 for the sampled token's logprob plus the
      top n alternatives.

    `n` is deliberately absent: the router fans a request with n > 1 out into
    n engine requests. A bad value raises ValueError naming the field.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # frozen: normalized values go in through object.__setattr__.
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("max_tokens", _int("max_tokens", self.max_tokens, lo=1))
        put("temperature", _float("temperature", self.temperature, lo=0.0))
        put("top_p", _float("top_p", self.top_p, lo=0.0, hi=1.0))
        if self.top_p == 0.0:
            raise ValueError("top_p must be in (0, 1], got 0")
        top_k = _int("top_k", self.top_k, lo=-1)
        put("top_k", 0 if top_k == -1 else top_k)
        put("min_p", _float("min_p", self.min_p, lo=0.0, hi=1.0))
        if self.seed is not None:
            put("seed", _int("seed", self.seed, lo=0, hi=2**64 - 1))
        put("repetition_penalty", _float("repetition_penalty", self.repetition_penalty))
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        put("frequency_penalty", _float("frequency_penalty", self.frequency_penalty, -2.0, 2.0))
        put("presence_penalty", _float("presence_penalty", self.presence_penalty, -2.0, 2.0))
        put("stop", _stop_strings(self.stop))
        put("stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            put("logprobs", _int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        """Build from decoded JSON; unknown fields raise ValueError naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown sampling field(s): {', '.join(unknown)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types (lists for tuples); `from_dict(to_dict())` round-trips."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        return out


def _int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name} must be {_bounds(lo, hi)}, got {value}")
    return value


def _float(name: str, value: Any, lo: float | None = None, hi: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name} must be {_bounds(lo, hi)}, got {value}")
    return value


def _bounds(lo: float | None, hi: float | None) -> str:
    if hi is None:
        return f">= {lo}"
    if lo is None:
        return f"<= {hi}"
    return f"in [{lo}, {hi}]"


def _stop_strings(value: Any) -> tuple[str, ...]:
    # OpenAI's API takes one string or a list of them.
    items = (value,) if isinstance(value, str) else value
    if items is None:
        return ()
    if not isinstance(items, list | tuple):
        raise ValueError(f"stop must be a string or a list of strings, got {value!r}")
    for s in items:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must hold non-empty strings, got {s!r}")
    return tuple(items)


def _token_ids(name: str, value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise ValueError(f"{name} must be a list of ints, got {value!r}")
    return tuple(_int(name, t, lo=0) for t in value)
