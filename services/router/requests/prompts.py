"""Step 3 of a request (services/router/requests/lifecycle.py): a validated ApiRequest ->
its prompts.

Each prompt is tokenized (through the chat template for chat), checked against the
context length and the vocabulary, and given its wire sampling (`SamplingSpec`), whose
fields and bounds are libs/common/engine/core/sampling_params.py's. Every refusal is a 400
naming the parameter.

`prepare` is CPU work proportional to the body (up to 16 MiB of text: seconds), so the
router runs it in a thread, after admission (services/router/requests/lifecycle.py), and text is
encoded by `encode`, which lets go of the GIL while the tokenizer works: a thread that
held it would stall the event loop, every other stream and the heartbeat just the same.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import msgspec
import orjson

from libs.common.engine.core.sampling_params import (
    MAX_GRAMMAR_CHARS,
    SamplingError,
    SamplingParams,
)
from libs.common.engine.load.tokenizer import TextTokenizer
from libs.common.messages.control import SamplingSpec
from services.router.defaults import NO_DEFAULTS, SamplingDefaults
from services.router.errors import bad_request
from services.router.formats.openai import vllm_fields
from services.router.formats.openai.chat_template import (
    DEFAULT_TEMPLATE,
    TemplateArgs,
    cut_after_final,
)
from services.router.formats.openai.validation import ApiRequest
from services.router.requests import prompt_cache
from services.router.structured import reasoning
from services.router.structured.tools import request as tools

# Prompt logprobs travel in one message (NATS: 1 MiB): scored tokens x (1 + logprobs)
# values at most, each ~40 bytes on the wire.
MAX_PROMPT_LOGPROB_VALUES = 16384


@dataclass
class Prompt:
    """One prompt of a request: its ids, its text (for echo) and its sampling. With echo
    and logprobs, the prompt is scored from token `score_from` on, and `offsets[i]` is
    where token i starts in `text` (None: not known, a prompt given as ids). `thinks`:
    where a reasoning model's output starts after a chat prompt (structured/reasoning.py),
    None when there is no thinking to split out."""

    token_ids: list[int]
    text: str
    sampling: SamplingSpec
    score_from: int = 0
    offsets: list[int] | None = None
    thinks: reasoning.Start | None = None


def prepare(
    api: ApiRequest,
    tokenizer: TextTokenizer,
    max_model_len: int,
    defaults: SamplingDefaults = NO_DEFAULTS,
) -> list[Prompt]:
    if api.endpoint == "chat":
        sources: list[str | list[int]] = [
            render_chat(tokenizer, api.messages, api.tools, api.template)
        ]
    else:
        sources = api.prompts
    vllm_fields.check_vocabulary(api.sampling, tokenizer.vocab_size)
    prompts = []
    for source in sources:
        if isinstance(source, str):
            try:
                ids, text = encode(tokenizer, source, max_model_len), source
            except PromptTooLong as e:  # the 400 with both lengths, from the count alone
                _max_tokens(api, e.num_tokens, max_model_len)
                raise bad_request(f"the prompt has {e.num_tokens} tokens", "prompt") from None
        else:
            if max(source) >= tokenizer.vocab_size:
                raise bad_request(f"token id {max(source)} is outside the vocabulary", "prompt")
            ids, text = source, tokenizer.decode(source) if api.echo else ""
        if not ids:
            raise bad_request("the prompt is empty after tokenization", "prompt")
        prompt = Prompt(ids, text, _sampling(api, len(ids), max_model_len, defaults))
        if api.endpoint == "chat":
            final = api.messages[-1]["content"] if api.template.continue_final_message else None
            _thinking(prompt, tokenizer, final, api.grammar.param if api.grammar else "")
        if api.echo and api.logprobs is not None:
            _score(api, api.logprobs, tokenizer, prompt, isinstance(source, str))
        elif api.vllm.prompt_logprobs is not None:  # vLLM's: the whole prompt, no offsets
            _score_from(prompt, api.vllm.prompt_logprobs, "prompt_logprobs")
        prompts.append(prompt)
    return prompts


def _thinking(prompt: Prompt, tokenizer: TextTokenizer, continued: str | None, param: str) -> None:
    """A reasoning model's chat prompt: where its output starts (`continued`: the final
    message's text it continues), and the request's grammar (asked by `param`) moved after
    the thinking; a 400 naming `param` when that makes it too long to send."""
    tags = reasoning.think_tags(tokenizer)
    prompt.thinks = reasoning.output_start(tags, prompt.text, continued)
    grammar = prompt.sampling.grammar
    if tags is not None and prompt.thinks is not None and grammar:
        wrapped = reasoning.after_thinking(grammar, tags, prompt.thinks)
        if len(wrapped) > MAX_GRAMMAR_CHARS:
            raise bad_request(
                f"'{param}' is over {MAX_GRAMMAR_CHARS} characters as a grammar after the "
                "model's thinking part",
                param,
            )
        prompt.sampling = msgspec.structs.replace(prompt.sampling, grammar=wrapped)


def _score(
    api: ApiRequest, logprobs: int, tokenizer: TextTokenizer, prompt: Prompt, text: bool
) -> None:
    """Echo with `logprobs` (the request's, set): the prompt's tokens are scored from the
    one that holds the character `prompt_logprobs_from` (0 when unset) on; 400s when that
    is not possible."""
    char_from = api.prompt_logprobs_from
    if text:
        spans = token_spans(tokenizer, prompt.text, len(prompt.token_ids))
        prompt.offsets = [start for start, _ in spans]
        if char_from is not None:
            prompt.score_from = next(
                (i for i, (_, end) in enumerate(spans) if end > char_from), len(spans)
            )
    elif char_from is not None:
        raise bad_request("'prompt_logprobs_from' needs a text prompt", "prompt_logprobs_from")
    _score_from(prompt, logprobs, "logprobs")


def _score_from(prompt: Prompt, logprobs: int, param: str) -> None:
    """Score `prompt` from token `score_from` on with the top `logprobs` at each; a 400
    naming `param` when the values would not fit one message."""
    values = (len(prompt.token_ids) - max(prompt.score_from, 1)) * (1 + logprobs)
    if values > MAX_PROMPT_LOGPROB_VALUES:
        raise bad_request(
            f"scoring this prompt takes {values} logprob values (tokens x (1 + {param})); "
            f"at most {MAX_PROMPT_LOGPROB_VALUES}: lower '{param}' or score from later "
            "with 'prompt_logprobs_from'",
            param,
        )
    prompt.sampling = msgspec.structs.replace(
        prompt.sampling, prompt_logprobs=logprobs, prompt_logprobs_from=prompt.score_from
    )


def token_spans(tokenizer: TextTokenizer, text: str, num_tokens: int) -> list[tuple[int, int]]:
    """The characters (start, end) of each of `encode(text)`'s tokens in `text`; a BOS
    that encode added, and special tokens the tokenizer adds, are (0, 0)."""
    encoding = tokenizer.tokenizer.encode_batch([text], add_special_tokens=True)[0]
    spans = [(start, end) for start, end in encoding.offsets]
    if len(spans) == num_tokens - 1:  # the BOS `encode` put in front
        spans = [(0, 0), *spans]
    if len(spans) != num_tokens:
        raise bad_request("the prompt's token offsets do not match its tokens", "prompt")
    return spans


def render_chat(
    tokenizer: TextTokenizer,
    messages: list[dict],
    tool_request: tools.ToolRequest | None = None,
    template: TemplateArgs = DEFAULT_TEMPLATE,
) -> str:
    """The prompt text the model's chat template makes of `messages`, as `template` asks
    (chat_template.py); a 400 naming "messages" when the template refuses them."""
    cached = _render_key(tokenizer, messages, tool_request, template)
    text = prompt_cache.TEXTS.get(cached) if cached is not None else None
    if text is not None:
        return text
    text = _render(tokenizer, messages, tool_request, template)
    if cached is not None:
        prompt_cache.TEXTS.put(cached, text)
    return text


def _render_key(
    tokenizer: TextTokenizer,
    messages: list[dict],
    tool_request: tools.ToolRequest | None,
    template: TemplateArgs,
) -> bytes | None:
    """The cache key of a chat's render: the hash of everything it depends on (orjson
    writes the dataclasses), or None when what was sent is not JSON (it is, from HTTP)."""
    try:
        data = orjson.dumps((messages, tool_request, template))
    except TypeError:
        return None
    return prompt_cache.key(tokenizer, data)


def _render(
    tokenizer: TextTokenizer,
    messages: list[dict],
    tool_request: tools.ToolRequest | None,
    template: TemplateArgs,
) -> str:
    try:
        has_tools = tools.template_has_tools(tokenizer.chat_template)
        rendered, extra = tools.render_messages(messages, tool_request, has_tools)
        text = tokenizer.apply_chat_template(
            rendered,
            add_generation_prompt=template.add_generation_prompt,
            **template.kwargs,
            **extra,
        )
    except Exception as e:  # a template may raise anything; the client sees why
        raise bad_request(f"cannot apply the chat template: {e}", "messages") from None
    if template.continue_final_message:
        text = cut_after_final(text, rendered[-1]["content"])
    return text


class PromptTooLong(Exception):
    """More tokens than the limit `encode` was given (`num_tokens`, BOS counted)."""

    def __init__(self, num_tokens: int):
        super().__init__(f"{num_tokens} tokens")
        self.num_tokens = num_tokens


def encode(tokenizer: TextTokenizer, text: str, limit: int | None = None) -> list[int]:
    """`tokenizer.encode(text)`, the same ids, without holding the GIL while it runs.

    The tokenizers library's `encode` holds the GIL for the whole call (a 16 MiB prompt:
    ~5-14 s on this host in which no other thread runs); `encode_batch_fast` releases it
    while Rust works and builds no offsets, so only the id list's conversion holds it
    (~0.08 s for 3M ids), and past `limit` tokens not even that: `PromptTooLong` carries
    the count, which is all a refusal needs. The BOS rule is TextTokenizer.encode's. A
    text seen before is not tokenized again (prompt_cache.py: ids kept by its hash).
    """
    key = prompt_cache.text_key(tokenizer, text)
    hit = prompt_cache.IDS.get(key) if key is not None else None
    if hit is not None:  # kept with the count the limit is checked on, first
        counted, ids = hit[0], hit[1:].tolist()
    else:
        encoding = tokenizer.tokenizer.encode_batch_fast([text], add_special_tokens=True)[0]
        counted = len(encoding)
        if limit is not None and counted > limit:
            raise PromptTooLong(counted + (1 if tokenizer.add_bos else 0))
        ids = encoding.ids
        bos = tokenizer.bos_token_id  # set whenever add_bos is
        if tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        if key is not None:
            prompt_cache.IDS.put(key, array("I", [counted, *ids]))
    if limit is not None and counted > limit:
        raise PromptTooLong(counted + (1 if tokenizer.add_bos else 0))
    return ids


def _sampling(
    api: ApiRequest, prompt_len: int, max_model_len: int, defaults: SamplingDefaults
) -> SamplingSpec:
    # max_tokens 0 (echo only): the engine samples one token, which the router drops.
    max_tokens = max(1, _max_tokens(api, prompt_len, max_model_len))
    # The fields the request left out take the deployment's defaults (defaults.py).
    values = {**defaults.fill(api.sampling), "max_tokens": max_tokens, "logprobs": api.logprobs}
    try:
        # Normalized as the engine will see them (top_k -1 -> 0, floats), checked again
        # against the bounds the API validation used.
        return SamplingSpec(**SamplingParams(**values).to_dict())
    except SamplingError as e:
        raise bad_request(str(e), e.field) from None


def _max_tokens(api: ApiRequest, prompt_len: int, max_model_len: int) -> int:
    """The request's max_tokens (the rest of the context when unset); a 400 with both
    lengths when the prompt leaves no room for it."""
    param = "messages" if api.endpoint == "chat" else "prompt"
    if api.max_tokens is None:
        if prompt_len >= max_model_len:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens; the prompt "
                f"has {prompt_len} tokens, which leaves no room for a completion.",
                param,
            )
        max_tokens = max_model_len - prompt_len
    else:
        max_tokens = api.max_tokens
        if prompt_len + max_tokens > max_model_len:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                f"{max_tokens} for the completion). Shorten the prompt or max_tokens.",
                param,
            )
    return max_tokens
