"""Sampling defaults: the value a field gets when a request leaves it out.

For each field, the first that sets it wins:

  1. the request itself (never overridden; prompts.py fills only what it left out); a
     request asking for greedy decoding gets no default penalty (its tokens stay the
     model's argmax, equal to the reference)
  2. the operator's --default-* flag (an explicit choice for this deployment)
  3. the model's own recommendation (an HF folder's generation_config.json, a GGUF's
     general.sampling.* metadata, or the default model's built-in ones:
     libs/common/engine/load/generation_config.py)
  4. SamplingParams's own defaults (temperature 1, top_p 1, top_k 0, min_p 0, penalty 1)

The model's own are read once, at start (services/router/service.py `load_defaults`); a
request only fills its fields from the result. docs/api.md ("Defaults") says the same to
clients.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from libs.common.flags import flag_name


@dataclass(frozen=True)
class SamplingDefaults:
    """Values for the fields that have a default above SamplingParams's, and where each
    came from (a flag name, a file, the default model's built-in ones)."""

    values: dict[str, int | float] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def fill(self, sampling: Mapping[str, Any]) -> dict[str, Any]:
        """`sampling` (the fields a request set) with the defaults for those it did not.
        A request that asks for greedy decoding (temperature 0 or top_k 1) gets exactly
        that: a default penalty would change its tokens, so none is added."""
        values = self.values
        if sampling.get("temperature") == 0 or sampling.get("top_k") == 1:
            values = {k: v for k, v in values.items() if k not in _PENALTIES}
        return {**values, **sampling}


_PENALTIES = ("repetition_penalty",)  # the defaults that change a greedy answer
NO_DEFAULTS = SamplingDefaults()  # SamplingParams's own defaults only


def merge_defaults(
    model: Mapping[str, int | float], model_source: str, flags: Mapping[str, int | float | None]
) -> SamplingDefaults:
    """The flags (None: not given) over the model's defaults, which came from `model_source`."""
    values: dict[str, int | float] = {}
    sources: dict[str, str] = {}
    for name in dict.fromkeys([*flags, *model]):  # every field either one names
        flag, own = flags.get(name), model.get(name)
        if flag is not None:
            values[name], sources[name] = flag, flag_name(f"default_{name}")
        elif own is not None:
            values[name], sources[name] = own, model_source
    return SamplingDefaults(values, sources)
