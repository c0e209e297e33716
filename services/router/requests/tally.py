"""Step 6 of a request (services/router/requests/lifecycle.py): its output as it arrives.

Each choice's output comes from dispatch as `Delta`s; the request's `Tally` adds them up
(per-choice text, token ids, logprobs; usage; the finish) for whichever format writes the
response: OpenAI's chat and completions (lifecycle.py), /v1/responses (responses.py),
/v1/messages (messages.py). A chat choice's text is read into its message's parts by the
Tally's `texts` (chat_text.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from services.router.formats.openai import shapes as fmt
from services.router.formats.openai.validation import ApiRequest
from services.router.formats.openai.vllm_fields import VllmOutput
from services.router.requests.chat_text import ChatText
from services.router.requests.prompts import Prompt
from services.router.state import RouterState


@dataclass
class Delta:
    """New output of one choice. The last one has `finish_reason` and the usage fields."""

    index: int
    prompt: int  # which prompt of the request this choice belongs to
    text: str
    token_ids: list[int]
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached: dict[str, int] = field(default_factory=dict)
    prompt_logprobs: list[dict] = field(default_factory=list)  # the first delta's
    stop_reason: str | int | None = None  # the last one's: the stop string or id hit


class Tally:
    """One request's response while its Deltas arrive: per-choice output and usage."""

    def __init__(self, state: RouterState, api: ApiRequest, prompts: list[Prompt], rid: str):
        self.state, self.api, self.prompts, self.rid = state, api, prompts, rid
        self.totals = fmt.Totals(prompt_tokens=sum(len(p.token_ids) for p in prompts))
        n = len(prompts) * api.n
        self.choices = [fmt.Choice(i) for i in range(n)]
        self.offsets = [0] * n  # text offset per choice, for completions logprobs
        # Echo with logprobs: each choice's scored prompt (from its first delta).
        self.scored = api.echo and api.logprobs is not None
        self.prompt_lps: dict[int, dict[str, Any]] = {}
        # max_tokens 0 with echo: the one token the engine had to sample is dropped.
        self.echo_only = api.echo and api.max_tokens == 0
        # A chat choice's text is split into its message's parts (chat_text.py): tool calls
        # for the request's tools unless it has none or tool_choice is "none" (`tools` None).
        self.tools = api.tools if api.tools is not None and api.tools.choice != "none" else None
        chat = api.endpoint == "chat"  # and a reasoning model's thinking (prompt.thinks)
        self.texts = [ChatText(self.tools, prompts[i // api.n].thinks) for i in range(n) if chat]
        ids = [prompts[i // api.n].token_ids for i in range(n)]  # vLLM's fields (vllm_fields.py)
        self.vllm = VllmOutput(api.vllm, chat, ids, state.tokenizer.eos_token_ids,
                               state.token_text)  # fmt: skip

    def add(self, d: Delta) -> None:
        if self.echo_only:
            d.text, d.token_ids, d.logprobs, d.completion_tokens = "", [], [], 0
            d.finish_reason = d.finish_reason and "length"
        if self.scored and d.index not in self.prompt_lps:
            self.prompt_lps[d.index] = self.echoed_logprobs(d)
        self.vllm.add_prompt_logprobs(d.index, d.prompt_logprobs)
        c = self.choices[d.index]
        c.text += d.text
        c.token_ids += d.token_ids
        c.logprobs += d.logprobs
        if d.finish_reason is not None:
            c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
            self.totals.completion_tokens += d.completion_tokens
            prompt_len = len(self.prompts[d.prompt].token_ids)
            if d.index % self.api.n == 0:  # a prompt counts once, as OpenAI bills it
                self.totals.cached_tokens += min(prompt_len, sum(d.cached.values()))
            self.state.metrics.finished(d.finish_reason, prompt_len, d.completion_tokens, d.cached)

    def echoed_logprobs(self, d: Delta) -> dict[str, Any]:
        """The scored prompt's logprobs: token 0 has none (nothing precedes it)."""
        prompt = self.prompts[d.prompt]
        entries = list(d.prompt_logprobs)
        if prompt.score_from == 0:
            entries.insert(0, {"token": prompt.token_ids[0], "logprob": None, "top": []})
        starts = prompt.offsets[prompt.score_from :] if prompt.offsets is not None else None
        return fmt.completion_logprobs(entries, self.state.token_text, 0, starts)

    def running_totals(self) -> fmt.Totals:
        """Usage so far, for continuous_usage_stats: cached tokens count once known."""
        done = self.totals.completion_tokens
        running = sum(len(c.token_ids) for c in self.choices if c.finish_reason is None)
        return dataclasses.replace(self.totals, completion_tokens=done + running)

    def logprobs(self, index: int, entries: list[dict[str, Any]], text: str) -> Any:
        if self.api.logprobs is None:
            return None
        if self.api.endpoint == "chat":
            return fmt.chat_logprobs(entries, self.state.token_text)
        out = fmt.completion_logprobs(entries, self.state.token_text, self.offsets[index])
        self.offsets[index] += len(text)
        return out
