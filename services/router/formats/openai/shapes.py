"""Response bodies in OpenAI's shapes: completions, chat completions, their stream chunks.

Pure functions from what the router collected (text, token ids, logprobs, usage) to the
JSON objects the `openai` client parses. Usage is exact: prompt tokens as tokenized here,
completion tokens as streamed, cached prompt tokens as the workers reported them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TokenText = Callable[[int], str]


@dataclass
class Choice:
    """What one choice produced so far (or in one stream delta)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or id that ended it (vLLM's)


@dataclass
class Totals:
    """Exact usage of a whole request (all prompts, all choices)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def completion_logprobs(
    entries: list[dict[str, Any]],
    token_text: TokenText,
    offset: int,
    starts: list[int] | None = None,
) -> dict[str, Any]:
    """Legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset.

    Offsets count on from `offset` by each token's text, or are `starts` when given (an
    echoed prompt's, from its tokenizer). An entry with logprob None (a prompt's first
    token: nothing precedes it) has None for its alternatives too, as OpenAI's."""
    tokens, lps, tops, offsets = [], [], [], []
    for i, e in enumerate(entries):
        text = token_text(e["token"])
        tokens.append(text)
        lps.append(e["logprob"])
        top = e.get("top", [])
        tops.append(None if e["logprob"] is None else {token_text(t): lp for t, lp in top})
        offsets.append(starts[i] if starts is not None else offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def joined_logprobs(first: dict[str, Any] | None, then: dict[str, Any] | None) -> Any:
    """Two legacy completions logprobs objects as one (an echoed prompt's, the output's)."""
    if first is None or then is None:
        return first if then is None else then
    return {key: first[key] + then[key] for key in first}


def chat_logprobs(entries: list[dict[str, Any]], token_text: TokenText) -> dict[str, Any]:
    def item(token: int, logprob: float) -> dict[str, Any]:
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = [
        {**item(e["token"], e["logprob"]), "top_logprobs": [item(t, x) for t, x in e["top"]]}
        for e in entries
    ]
    return {"content": content, "refusal": None}


def completion_body(
    rid: str, created: int, model: str, choices: list[dict[str, Any]], usage: Totals | None
) -> dict[str, Any]:
    body = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "system_fingerprint": None,
    }
    if usage is not None:
        body["usage"] = usage.body()
    return body


def completion_choice(c: Choice, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "index": c.index,
        "text": c.text,
        "logprobs": logprobs,
        "finish_reason": c.finish_reason,
    }


def chat_body(
    rid: str, created: int, model: str, choices: list[dict[str, Any]], usage: Totals | None
) -> dict[str, Any]:
    body = completion_body(rid, created, model, choices, usage)
    body["object"] = "chat.completion"
    return body


def chat_choice(
    c: Choice, logprobs: dict[str, Any] | None, tool_calls: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """A chat choice; with `tool_calls` (streaming-shaped, their `index` dropped here) the
    message carries them, and its content is null when the model wrote nothing else."""
    message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
    if tool_calls:
        message["tool_calls"] = [{k: v for k, v in t.items() if k != "index"} for t in tool_calls]
        message["content"] = c.text or None
    return {
        "index": c.index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": c.finish_reason,
    }


def chat_chunk(
    rid: str, created: int, model: str, choices: list[dict[str, Any]], usage: Totals | None
) -> dict[str, Any]:
    body = completion_body(rid, created, model, choices, None)
    body["object"] = "chat.completion.chunk"
    body["usage"] = usage.body() if usage is not None else None
    return body


def chat_delta(
    index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None, finish: str | None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def completion_delta(
    index: int, text: str, logprobs: dict[str, Any] | None, finish: str | None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def completion_chunk(
    rid: str, created: int, model: str, choices: list[dict[str, Any]], usage: Totals | None
) -> dict[str, Any]:
    body = completion_body(rid, created, model, choices, None)
    body["usage"] = usage.body() if usage is not None else None
    return body


def models_body(model: str, created: int, max_model_len: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "tandem",
                "max_model_len": max_model_len,
            }
        ],
    }
