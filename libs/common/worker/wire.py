"""The bus's request and token formats <-> the engine's: sampling in, logprobs out.

Both roles convert the same way: a GenerateRequest's or PrefillRequest's SamplingSpec to
the engine's SamplingParams, and the engine's logprobs to TokenChunk entries.
"""

from __future__ import annotations

from collections.abc import Sequence

from libs.common.engine.core.outputs import TokenLogprobs
from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.messages.control import SamplingSpec


def sampling_params(spec: SamplingSpec) -> SamplingParams:
    """Wire sampling -> engine sampling; ValueError (naming the field) when invalid."""
    body = {k: v for k, v in spec.to_dict().items() if k not in ("v", "type")}
    return SamplingParams.from_dict(body)


def logprobs_wire(items: Sequence[TokenLogprobs | None]) -> list[dict]:
    """Engine logprobs -> TokenChunk.logprobs entries (with "rank" where it was computed:
    a prompt token's)."""
    out = []
    for lp in items:
        if lp is not None:
            entry = {"token": lp.token_id, "logprob": lp.logprob, "top": [list(t) for t in lp.top]}
            if lp.rank is not None:
                entry["rank"] = lp.rank
            out.append(entry)
    return out
