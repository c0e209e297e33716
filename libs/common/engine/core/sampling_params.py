"""How one request samples its tokens: every field and its bounds, defined once.

`BOUNDS` and the stop limits below are the one truth about which values are accepted, with
OpenAI's bounds where OpenAI documents one (docs/api.md). Three places check against them:
the router's API validation (a 400 naming the parameter,
services/router/formats/openai/validation.py), the wire's `SamplingSpec`
(libs/common/messages/control.py, a MessageError on decode) and the engine's
`SamplingParams` here (a ValueError naming the field). The fields themselves are
SamplingParams's: the wire message is derived from it, field by field. Standard library
only: the router and the messages package import it without the engine.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

# vLLM's default cap on top-n logprobs: enough for any UI, bounded work per token.
MAX_LOGPROBS = 20
# Stop conditions per request; they also keep a GenerateRequest well under NATS's 1 MiB max
# payload (the prompt itself is bounded by the context length).
MAX_STOP = 16
MAX_STOP_CHARS = 4096
MAX_STOP_IDS = 1024
MAX_TOKEN_ID = 2**31 - 1
# A grammar (libs/common/grammar) travels in the generate request: bounded like the stops.
MAX_GRAMMAR_CHARS = 256 * 1024
# A tenant's cache salt (kv_hash.chain_root): long enough for a random secret or a tenant
# id with a key, bounded like every field that travels in the generate request.
MAX_CACHE_SALT_CHARS = 256
# logit_bias: OpenAI's range per token, and at most this many tokens biased per request.
MAX_LOGIT_BIAS = 300
LOGIT_BIAS = 100.0


class SamplingError(ValueError):
    """A sampling value out of its bounds; `field` names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True, slots=True)
class Bound:
    """The numbers one field accepts: `kind` (int or float) in [lo, hi], `lo_open` excluding
    lo, None unbounded on that side. `help` is the field's one line in the API's document."""

    kind: type
    help: str
    lo: int | float | None = None
    hi: int | float | None = None
    lo_open: bool = False

    def check(self, name: str, value: Any) -> int | float:
        """`value` as this kind (ints stay ints, numbers become floats); SamplingError else."""
        if self.kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise SamplingError(name, f"'{name}' must be an integer, got {value!r}")
            number: int | float = value
        else:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise SamplingError(name, f"'{name}' must be a number, got {value!r}")
            number = float(value)
            if not math.isfinite(number):
                raise SamplingError(name, f"'{name}' must be finite, got {number}")
        low = self.lo is not None and (number <= self.lo if self.lo_open else number < self.lo)
        if low or (self.hi is not None and number > self.hi):
            raise SamplingError(name, f"'{name}' must be in {self.interval}, got {number}")
        return number

    @property
    def interval(self) -> str:
        lo = ("(" if self.lo_open else "[") + ("-inf" if self.lo is None else _num(self.lo))
        return f"{lo}, " + ("inf)" if self.hi is None else f"{_num(self.hi)}]")


BOUNDS: dict[str, Bound] = {
    "max_tokens": Bound(int, "tokens to generate at most", lo=1),
    "temperature": Bound(float, "0 is greedy", lo=0, hi=2),
    "top_p": Bound(float, "nucleus sampling", lo=0, hi=1, lo_open=True),
    "top_k": Bound(int, "keep the k likeliest tokens (0 or -1: off)", lo=-1),
    "min_p": Bound(float, "drop tokens below min_p x the top probability", lo=0, hi=1),
    "seed": Bound(int, "reproducible sampling", lo=0, hi=2**63 - 1),
    "repetition_penalty": Bound(float, "multiplicative, 1 is off", lo=0, lo_open=True),
    "frequency_penalty": Bound(float, "additive, per occurrence", lo=-2, hi=2),
    "presence_penalty": Bound(float, "additive, on generated tokens", lo=-2, hi=2),
    "logprobs": Bound(int, "log probabilities of the top n tokens", lo=0, hi=MAX_LOGPROBS),
    "min_tokens": Bound(int, "no EOS or stop before this many tokens", lo=0),
}
_OPTIONAL = ("seed", "logprobs")  # None: not set


def check_stop(name: str, value: Any) -> tuple[str, ...]:
    """One string or a list of up to MAX_STOP non-empty strings (OpenAI's two shapes)."""
    items = (value,) if isinstance(value, str) else value
    if items is None:
        return ()
    ok = isinstance(items, list | tuple) and all(isinstance(s, str) and s for s in items)
    if not ok or len(items) > MAX_STOP:
        raise SamplingError(name, f"'{name}' must be a string or up to {MAX_STOP} strings")
    if any(len(s) > MAX_STOP_CHARS for s in items):
        raise SamplingError(name, f"'{name}': a stop string is at most {MAX_STOP_CHARS} chars")
    return tuple(items)


def check_token_ids(name: str, value: Any) -> tuple[int, ...]:
    """Up to MAX_STOP_IDS token ids, each in [0, MAX_TOKEN_ID]."""
    if value is None:
        return ()
    ok = isinstance(value, list | tuple) and all(
        not isinstance(t, bool) and isinstance(t, int) and 0 <= t <= MAX_TOKEN_ID for t in value
    )
    if not ok:
        raise SamplingError(name, f"'{name}' must be a list of token ids (integers >= 0)")
    if len(value) > MAX_STOP_IDS:
        raise SamplingError(name, f"'{name}' takes at most {MAX_STOP_IDS} token ids")
    return tuple(value)


_BIAS = Bound(float, "added to the token's logit", lo=-LOGIT_BIAS, hi=LOGIT_BIAS)


def check_logit_bias(name: str, value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{token_id: bias}` (ids as strings or integers) or (id, bias) pairs, as
    pairs sorted by id: up to MAX_LOGIT_BIAS ids in [0, MAX_TOKEN_ID], each bias in
    [-LOGIT_BIAS, LOGIT_BIAS]. Which ids the model has is the vocabulary's business."""
    if value is None:
        return ()
    pairs = list(value.items()) if isinstance(value, Mapping) else value
    if not isinstance(pairs, list | tuple) or not all(
        isinstance(p, list | tuple) and len(p) == 2 for p in pairs
    ):
        raise SamplingError(name, f"'{name}' must be an object of token id -> bias")
    if len(pairs) > MAX_LOGIT_BIAS:
        raise SamplingError(name, f"'{name}' takes at most {MAX_LOGIT_BIAS} token ids")
    out: dict[int, float] = {}
    for key, bias in pairs:
        token = key
        if isinstance(key, str) and key.isascii() and key.isdigit():
            token = int(key)
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= MAX_TOKEN_ID:
            raise SamplingError(name, f"'{name}': {key!r} is not a token id")
        try:
            out[token] = float(_BIAS.check(name, bias))
        except SamplingError as e:
            raise SamplingError(name, f"{e} (token {token})") from None
    return tuple(sorted(out.items()))


def check_sampling(obj: Any) -> dict[str, Any]:
    """Every sampling field of `obj` (attributes named as SamplingParams's fields) checked,
    as normalized values; SamplingError (a ValueError) naming the first bad field."""
    out: dict[str, Any] = {}
    for name, bound in BOUNDS.items():
        value = getattr(obj, name)
        out[name] = None if value is None and name in _OPTIONAL else bound.check(name, value)
    out["stop"] = check_stop("stop", obj.stop)
    out["stop_token_ids"] = check_token_ids("stop_token_ids", obj.stop_token_ids)
    if not isinstance(obj.ignore_eos, bool):
        raise SamplingError("ignore_eos", f"'ignore_eos' must be a boolean, got {obj.ignore_eos!r}")
    if not isinstance(obj.grammar, str) or len(obj.grammar) > MAX_GRAMMAR_CHARS:
        raise SamplingError("grammar", f"'grammar' must be a string, <= {MAX_GRAMMAR_CHARS} chars")
    if obj.prompt_logprobs is not None:
        out["prompt_logprobs"] = BOUNDS["logprobs"].check("prompt_logprobs", obj.prompt_logprobs)
    out["prompt_logprobs_from"] = _PROMPT_FROM.check(
        "prompt_logprobs_from", obj.prompt_logprobs_from
    )
    out["cache_salt"] = check_cache_salt("cache_salt", obj.cache_salt, allow_empty=True)
    out["logit_bias"] = check_logit_bias("logit_bias", obj.logit_bias)
    if out["min_tokens"] > out["max_tokens"]:
        raise SamplingError(
            "min_tokens",
            f"'min_tokens' ({out['min_tokens']}) must be at most 'max_tokens' "
            f"({out['max_tokens']})",
        )
    return out


def check_cache_salt(name: str, value: Any, allow_empty: bool = False) -> str:
    """A string of 1..MAX_CACHE_SALT_CHARS chars ("" too with `allow_empty`: no salt, the
    engine's default; an API request that sends the field must salt)."""
    if not (isinstance(value, str) and (allow_empty or value)) or len(value) > MAX_CACHE_SALT_CHARS:
        raise SamplingError(
            name, f"'{name}' must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters"
        )
    return str(value)


# Not in BOUNDS: the API sets them from `echo`, `logprobs` and `prompt_logprobs_from`
# (services/router), not from a body field of the same name.
_PROMPT_FROM = Bound(int, "first prompt token to score", lo=0, hi=MAX_TOKEN_ID)


def _num(x: int | float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


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
      top n alternatives (of the constrained distribution when there is a grammar);
    - grammar: "" for none, else a grammar in llguidance's format (libs/common/grammar)
      that every sampled token must follow; generation stops when it is complete;
    - prompt_logprobs: None for none, n >= 0 for the logprob of every prompt token from
      index `prompt_logprobs_from` on (token 0 has none: nothing precedes it) plus the
      top n alternatives at each. Those positions are computed, never read from the
      prefix cache: the cached prefix stops at the first one (`prompt_logits_from`);
    - cache_salt: "" for none, else the request's pages are keyed apart from every other
      salt's (kv_hash.chain_root): no cache tier shares a page across salts;
    - logit_bias: (token id, bias) pairs, the bias added to that token's logit before
      sampling (and before logprobs), at every step including the first (a prefill worker's);
    - min_tokens: EOS (unless ignore_eos), stop_token_ids and stop strings do not end
      the completion before it has this many tokens (the sampler masks the tokens).

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
    grammar: str = ""
    prompt_logprobs: int | None = None
    prompt_logprobs_from: int = 0
    cache_salt: str = ""
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0

    def __post_init__(self) -> None:
        # frozen: normalized values go in through object.__setattr__.
        for name, value in check_sampling(self).items():
            object.__setattr__(self, name, value)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def token_ids_by_field(self) -> dict[str, tuple[int, ...]]:
        """The token ids this request names, by field: each must be in the vocabulary."""
        return {
            "stop_token_ids": self.stop_token_ids,
            "logit_bias": tuple(token for token, _ in self.logit_bias),
        }

    @property
    def prompt_logits_from(self) -> int | None:
        """The first position whose logits the prompt's logprobs need (they score the
        token after it), or None without prompt logprobs."""
        if self.prompt_logprobs is None:
            return None
        return max(self.prompt_logprobs_from, 1) - 1

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
        out["logit_bias"] = [list(pair) for pair in self.logit_bias]
        return out
