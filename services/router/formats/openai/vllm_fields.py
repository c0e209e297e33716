"""vLLM's and SGLang's extensions of OpenAI's chat and completions APIs: the request
fields (checked here, their rows in validation.py's Spec tables) and what they add to a
response.

Request:
- `logit_bias` (OpenAI's field, vLLM's limits): {token id: bias in [-100, 100]}, at most
  MAX_LOGIT_BIAS ids, each in the vocabulary; applied by the engine's sampler at every step
  (libs/common/engine/model/sampler.py). `min_tokens` is a plain sampling bound (BOUNDS).
- `stop_token_ids` and `logit_bias` ids outside the vocabulary: 400 naming the field.
- `prompt_logprobs` n: every prompt token's logprob, rank and the top n (the prompt
  scoring path of echo with logprobs; streamed: in a choice's first chunk); refused with
  echo's own scoring.
- `return_token_ids`: the output's token ids per choice and the prompt's.
- `stream_options.continuous_usage_stats` (with `include_usage`): usage in every chunk.

Response (vLLM's field names): each choice's `stop_reason` (the stop string or stop token
id that ended it; null for EOS, a length cut or a complete grammar) and SGLang's
`matched_stop` (the same, and the EOS token id when EOS ended it); with return_token_ids
a choice's `token_ids` and the `prompt_token_ids` (in the choice for completions, at the
top for chat); with prompt_logprobs vLLM's list: null for the first token, then
{token id: {logprob, rank, decoded_token}} per prompt token.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from libs.common.engine.core.sampling_params import SamplingError, check_logit_bias
from services.router.errors import bad_request
from services.router.formats.openai import shapes as fmt

_PROMPT_FIELDS = ("prompt_token_ids", "prompt_logprobs")


@dataclass(frozen=True)
class VllmFields:
    """The extension fields of one request, checked."""

    return_token_ids: bool = False
    prompt_logprobs: int | None = None
    include_usage: bool = False
    continuous_usage: bool = False


def parse(v: dict[str, Any], stream: bool, echo_scored: bool) -> VllmFields:
    """`v`: the body's values by Spec name (validation.py has checked their JSON kinds and
    bounds). `echo_scored`: the request scores its prompt through echo with logprobs."""
    options = v["stream_options"] or {}
    if options and not stream:
        raise bad_request("'stream_options' is only allowed with 'stream': true", "stream_options")
    for key, value in options.items():  # the keys are validation.py's STREAM_OPTIONS
        if not isinstance(value, bool):
            raise bad_request(f"'stream_options.{key}' must be a boolean", "stream_options")
    include = options.get("include_usage", False)
    continuous = options.get("continuous_usage_stats", False)
    if continuous and not include:
        raise bad_request(
            "'stream_options.continuous_usage_stats' needs 'include_usage': true",
            "stream_options",
        )
    prompt_logprobs = v["prompt_logprobs"]
    if prompt_logprobs is not None and echo_scored:
        raise bad_request(
            "'prompt_logprobs' and 'echo' with 'logprobs' both score the prompt: use one",
            "prompt_logprobs",
        )
    return VllmFields(bool(v["return_token_ids"]), prompt_logprobs, include, continuous)


def logit_bias(value: Any) -> list[list[int | float]]:
    """The body's `logit_bias` as the wire's (id, bias) pairs; a 400 naming it."""
    try:
        return [[token, bias] for token, bias in check_logit_bias("logit_bias", value)]
    except SamplingError as e:
        raise bad_request(str(e), "logit_bias") from None


def check_vocabulary(sampling: dict[str, Any], vocab_size: int) -> None:
    """Token ids a request names (stop_token_ids, logit_bias) must be the model's: a 400
    naming the field otherwise, as vLLM does."""
    named = {
        "stop_token_ids": sampling.get("stop_token_ids") or [],
        "logit_bias": [token for token, _ in sampling.get("logit_bias") or []],
    }
    for name, ids in named.items():
        outside = sorted(t for t in ids if t >= vocab_size)
        if outside:
            raise bad_request(
                f"'{name}': token id {outside[0]} is outside the vocabulary (size {vocab_size})",
                name,
            )


def matched_stop(c: fmt.Choice, eos_token_ids: Collection[int]) -> str | int | None:
    """SGLang's matched_stop: the stop string or id, or the EOS id that ended the choice."""
    if c.stop_reason is not None or c.finish_reason not in ("stop", "tool_calls"):
        return c.stop_reason
    last = c.token_ids[-1] if c.token_ids else None
    return last if last in eos_token_ids else None


def vllm_prompt_logprobs(
    entries: list[dict[str, Any]], token_text: Callable[[int], str]
) -> list[dict[str, Any] | None]:
    """TokenChunk prompt logprobs (tokens 1..) -> vLLM's list, None for token 0."""
    out: list[dict[str, Any] | None] = [None]
    for e in entries:
        scored = {str(e["token"]): _logprob(e["token"], e["logprob"], e.get("rank"), token_text)}
        for rank, (token, logprob) in enumerate(e.get("top", []), start=1):
            scored.setdefault(str(token), _logprob(token, logprob, rank, token_text))
        out.append(scored)
    return out


def _logprob(token: int, logprob: float, rank: int | None, text: Callable[[int], str]) -> dict:
    return {"logprob": logprob, "rank": rank, "decoded_token": text(token)}


@dataclass
class VllmOutput:
    """What a request's extension fields add to its response, choice by choice.
    `prompt_ids[i]`: the prompt token ids of choice i."""

    fields: VllmFields
    chat: bool
    prompt_ids: list[list[int]]
    eos_token_ids: Collection[int]
    token_text: Callable[[int], str]
    prompt_lps: dict[int, list[dict[str, Any] | None]] = field(default_factory=dict)
    pending: dict[int, list[int]] = field(default_factory=dict)  # streamed ids not yet sent
    started: set[int] = field(default_factory=set)  # choices whose prompt ids went out

    def add_prompt_logprobs(self, index: int, entries: list[dict[str, Any]]) -> None:
        """A choice's scored prompt (its first delta's), when prompt_logprobs was asked."""
        if self.fields.prompt_logprobs is not None and index not in self.prompt_lps:
            self.prompt_lps[index] = vllm_prompt_logprobs(entries, self.token_text)

    def choice(self, c: fmt.Choice) -> dict[str, Any]:
        """The fields a finished choice's body gets."""
        out: dict[str, Any] = {
            "stop_reason": c.stop_reason,
            "matched_stop": matched_stop(c, self.eos_token_ids),
        }
        if self.fields.return_token_ids:
            out["token_ids"] = list(c.token_ids)
            if not self.chat:
                out["prompt_token_ids"] = self.prompt_ids[c.index]
        if self.fields.prompt_logprobs is not None and not self.chat:
            out["prompt_logprobs"] = self.prompt_lps.get(c.index, [None])
        return out

    def body(self) -> dict[str, Any]:
        """The fields a chat body gets at its top (of its first choice's prompt)."""
        out: dict[str, Any] = {}
        if self.chat and self.fields.return_token_ids:
            out["prompt_token_ids"] = self.prompt_ids[0]
        if self.chat and self.fields.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_lps.get(0, [None])
        return out

    def lift(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """A streamed chat chunk with its choice's prompt fields (`prompt_token_ids`,
        `prompt_logprobs`) at the chunk's top, as vLLM's chat bodies have them
        (completions keep them in the choice)."""
        if self.chat and (self.fields.return_token_ids or self.fields.prompt_logprobs is not None):
            for choice in chunk["choices"]:
                for key in _PROMPT_FIELDS:
                    if key in choice:
                        chunk[key] = choice.pop(key)
        return chunk

    def chunk_choice(
        self, index: int, token_ids: list[int], emitted: bool, done: fmt.Choice | None
    ) -> dict[str, Any]:
        """The fields a streamed event of choice `index` gets: the ids of its tokens since
        its last event (and the prompt's fields on its first); on its last, the stop
        fields. `emitted`: this delta has an event (a held-back text has none: its ids
        wait for the next one)."""
        out: dict[str, Any] = {}
        if self.fields.return_token_ids:
            pending = self.pending.setdefault(index, [])
            pending += token_ids
            if emitted:
                out["token_ids"], self.pending[index] = pending, []
        if emitted and index not in self.started:
            self.started.add(index)
            if self.fields.return_token_ids:
                out["prompt_token_ids"] = self.prompt_ids[index]
            if self.fields.prompt_logprobs is not None:
                out["prompt_logprobs"] = self.prompt_lps.get(index, [None])
        if done is not None:
            out["stop_reason"] = done.stop_reason
            out["matched_stop"] = matched_stop(done, self.eos_token_ids)
        return out
