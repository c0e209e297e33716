"""What the engine hands back per request and step."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class TokenLogprobs:
    """The sampled token's logprob and the top-n alternatives (id, logprob), best first;
    `rank`: 1 + the number of tokens likelier than it, where it was asked for."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None


@dataclasses.dataclass(slots=True)
class RequestOutput:
    """New tokens of one request since its previous output.

    `token_ids`/`text` are deltas (text never ends inside a UTF-8 character
    and never shows part of a stop string). On the last output `finished` is
    set and `finish_reason` is "stop", "length", "abort", or None for a
    prefill-only request (it stopped after its first token by design). When
    the request keeps its pages (prefill-only, keep_pages) the last output
    carries `page_table`, the pages holding the KV of `all_token_ids`
    positions in order, valid until `Engine.release(request_id)`.

    With `prompt_logprobs` set in its sampling, a request's first output carries the
    logprobs of its prompt tokens from index max(prompt_logprobs_from, 1) on, in order.

    A prefill-only request also gets progress outputs after each chunk that did not
    sample: no tokens, not finished, and `page_table` listing the pages whose KV is final
    already (so a transfer can overlap the next chunk's compute).
    """

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    page_table: list[int] | None = None
    prompt_logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    # finish_reason "stop": the stop string or stop token id that ended it, None for EOS
    # or a complete grammar (vLLM's stop_reason)
    stop_reason: str | int | None = None
    # seconds from joining the queue (add_request; a handed-over prompt: add_imported) to
    # the request's first step (Sequence.queue_time), on every output once it ran; a phase
    # of its trace
    queue_time: float | None = None
