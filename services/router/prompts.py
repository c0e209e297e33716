"""Step 2 of a request (services/router/lifecycle.py): a validated ApiRequest -> its prompts.

Each prompt is tokenized (through the chat template for chat), checked against the
context length and the vocabulary, and given its wire sampling (`SamplingSpec`), whose
fields and bounds are libs/common/engine/core/sampling_params.py's. Every refusal is a 400
naming the parameter.

`prepare` is CPU work proportional to the body (up to 16 MiB of text: seconds), so the
router runs it in a thread, after admission (services/router/lifecycle.py), and text is
encoded by `encode`, which lets go of the GIL while the tokenizer works: a thread that
held it would stall the event loop, every other stream and the heartbeat just the same.
"""

from __future__ import annotations

from dataclasses import dataclass

from libs.common.engine.core.sampling_params import SamplingError, SamplingParams
from libs.common.engine.load.tokenizer import TextTokenizer
from libs.common.messages.control import SamplingSpec
from services.router import tools
from services.router.defaults import NO_DEFAULTS, SamplingDefaults
from services.router.errors import bad_request
from services.router.validation import ApiRequest


@dataclass
class Prompt:
    """One prompt of a request: its ids, its text (for echo) and its sampling."""

    token_ids: list[int]
    text: str
    sampling: SamplingSpec


def prepare(
    api: ApiRequest,
    tokenizer: TextTokenizer,
    max_model_len: int,
    defaults: SamplingDefaults = NO_DEFAULTS,
) -> list[Prompt]:
    if api.endpoint == "chat":
        try:
            has_tools = tools.template_has_tools(tokenizer.chat_template)
            messages, extra = tools.render_messages(api.messages, api.tools, has_tools)
            text = tokenizer.apply_chat_template(messages, **extra)
        except Exception as e:  # a template may raise anything; the client sees why
            raise bad_request(f"cannot apply the chat template: {e}", "messages") from None
        sources: list[str | list[int]] = [text]
    else:
        sources = api.prompts
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
        prompts.append(Prompt(ids, text, _sampling(api, len(ids), max_model_len, defaults)))
    return prompts


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
    the count, which is all a refusal needs. The BOS rule is TextTokenizer.encode's.
    """
    encoding = tokenizer.tokenizer.encode_batch_fast([text], add_special_tokens=True)[0]
    if limit is not None and len(encoding) > limit:
        raise PromptTooLong(len(encoding) + (1 if tokenizer.add_bos else 0))
    ids = encoding.ids
    if tokenizer.add_bos and (not ids or ids[0] != tokenizer.bos_token_id):
        ids = [tokenizer.bos_token_id, *ids]
    return ids


def _sampling(
    api: ApiRequest, prompt_len: int, max_model_len: int, defaults: SamplingDefaults
) -> SamplingSpec:
    max_tokens = _max_tokens(api, prompt_len, max_model_len)
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
