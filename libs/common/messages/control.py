"""Every message that crosses a process boundary over NATS, in one place.

Each message is a msgspec Struct (libs/common/messages/schema.py) encoded as one JSON
object with two envelope fields:

    {"type": "service_info", ...fields..., "v": 1}

`v` is the schema version: a receiver refuses a version it does not know, with an error
that says both versions. Unknown fields are ignored (a newer sender may add optional
fields without a version bump); missing required fields and wrong types are refused with
`MessageError` naming the field. Nothing is pickled or evaluated: every message, and every
message nested in another, goes through the one decoder in schema.py.

Subjects and which message travels on each are listed in docs/protocol.md; the KV pool's
messages are in libs/common/messages/pool.py and mounts.py.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import msgspec
from msgspec import field

from libs.common.engine.core.sampling_params import SamplingParams, check_sampling

# The envelope and decoder live in schema.py; these names stay importable here.
from libs.common.messages.schema import SCHEMA_VERSION as SCHEMA_VERSION
from libs.common.messages.schema import M as M
from libs.common.messages.schema import Message as Message
from libs.common.messages.schema import MessageError as MessageError

# --- generic replies --------------------------------------------------------------------


class ErrorReply(Message, tag="error"):
    """Body of an error reply (the `Nats-Service-Error[-Code]` headers say the same)."""

    code: int
    message: str


class InfoRequest(Message, tag="info_request"):
    """Asks a service for its `ServiceInfo`. Empty today; a body is optional."""


class ServiceInfo(Message, tag="service_info"):
    """Reply of every service's `info` endpoint.

    `details` holds what is specific to a role (model id, page size, kv dtype, transport…),
    as plain strings, numbers and booleans.
    """

    service: str
    service_id: str
    version: str
    started_at: float
    nats_url: str
    details: dict[str, Any] = field(default_factory=dict)


# --- the request path: router -> decode -> prefill, tokens back on a stream subject -------
#
#   router                     decode worker <id>                prefill worker <pid>
#     | sub tandem.stream.<rid>       |                                  |
#     |-- GenerateRequest ----------->| reserve pages                    |
#     |   tandem.decode.<id>.generate |-- PrefillRequest --------------->| compute, write KV
#     |<-- GenerateAccepted ----------|   tandem.prefill.<pid>.prefill   | into the reserved
#     |<======== TokenChunk (index 0, the first token) ==================| pages
#     |                               |<-- PrefillResult (check value) --|
#     |<== TokenChunk (index 1..) ====| decode, then the last chunk carries finish + usage
#
# A GenerateRequest with no prefill worker is prefilled by the decode worker itself
# (conditional disaggregation). Chunks are ordered by `index`: the first token comes from
# the prefill worker's connection, the rest from the decode worker's, and NATS orders
# messages per connection only, so the router reorders by index.


def _wire_form_of_sampling_params() -> type[msgspec.Struct]:
    """`SamplingSpec`: SamplingParams's fields, types and defaults as a wire message (its
    tuples travel as JSON arrays), checked when built or decoded against the same table."""
    hints = typing.get_type_hints(SamplingParams)
    fields = []
    for f in dataclasses.fields(SamplingParams):
        if f.default is not dataclasses.MISSING:
            fields.append((f.name, hints[f.name], f.default))
        elif f.default_factory is not dataclasses.MISSING:
            fields.append((f.name, hints[f.name], msgspec.field(default_factory=f.default_factory)))
        else:
            raise TypeError(f"SamplingParams.{f.name} has no default: the wire form needs one")

    def __post_init__(self) -> None:
        check_sampling(self)  # a bad value raises ValueError naming the field

    return msgspec.defstruct(
        "SamplingSpec", fields, bases=(Message,), tag="sampling",
        module=__name__, namespace={"__post_init__": __post_init__},
    )  # fmt: skip


# Sampling parameters on the wire: the fields are SamplingParams's (defined once, in
# libs/common/engine/core/sampling_params.py, with their bounds).
if typing.TYPE_CHECKING:
    # The type checker cannot see a class built at run time: it sees this face instead
    # (keyword construction, every field read as Any).
    class SamplingSpec(Message, tag="sampling"):
        def __init__(self, **fields: Any) -> None: ...
        def __getattr__(self, name: str) -> Any: ...

else:
    SamplingSpec = _wire_form_of_sampling_params()


class GenerateRequest(Message, tag="generate"):
    """Router -> decode worker: generate a completion for `token_ids`.

    `prefill_worker` names the prefill worker to compute the prompt, or is empty when the
    decode worker prefills it itself. Tokens go to `stream_subject` as TokenChunk messages.
    `timeout` bounds the whole request in seconds; past it every worker frees its pages.
    """

    request_id: str
    token_ids: list[int]
    sampling: SamplingSpec
    stream_subject: str
    prefill_worker: str = ""
    timeout: float = 600.0
    # Where the decode worker sends this request's chunks batched with the other requests'
    # of the same router (TokenChunkBatch), or empty: one TokenChunk per publish on
    # `stream_subject`. Token 0 from a prefill worker always goes to `stream_subject`.
    batch_subject: str = ""
    # The sending router's instance id (random per router process, `RouterHeartbeat`).
    # Workers key a request by (router, request_id): `request_id` is unique only within
    # its router instance. A worker cancels the request when that router's heartbeats stop.
    # Empty (a direct client): keyed by `request_id` alone, never watched.
    router: str = ""
    # The client's X-Request-Id: a label for log lines, never a key.
    label: str = ""
    # A migrated request (its first decode worker died): the completion's tokens the
    # client already has. The worker prefills `token_ids + generated` itself (never through
    # a prefill worker), counts them as output (max_tokens, penalties, seed step, usage),
    # replays them through the grammar and stop strings, and streams from index
    # len(generated) on. `token_ids` stays the client's prompt (usage.prompt_tokens).
    generated: list[int] = field(default_factory=list)


class GenerateAccepted(Message, tag="generate_accepted"):
    """Decode worker -> router: the request holds its pages and is queued."""

    request_id: str
    decode_worker: str
    num_reserved_pages: int
    num_held_pages: int = 0  # reserved pages this worker's cache already filled: not sent


class PrefillRequest(Message, tag="prefill"):
    """Decode -> prefill worker: compute `token_ids` and write their KV into my pages.

    `kv_region` is the decode worker's KV-pool region descriptor (transfer engine, plain
    data); `page_indices[i]` receives prompt page `i + skip_pages` (the first `skip_pages`
    pages the decode worker already holds from its own prefix cache). `model_id`,
    `page_size` and `kv_dtype` must equal the prefill worker's, or it refuses to pair.
    """

    request_id: str
    token_ids: list[int]
    sampling: SamplingSpec
    stream_subject: str
    decode_worker: str
    kv_region: dict[str, Any]
    page_indices: list[int]
    skip_pages: int
    model_id: str
    page_size: int
    kv_dtype: str
    kv_num_pages: int
    timeout: float = 600.0
    router: str = ""  # GenerateRequest.router: the key is (router, request_id)


class PrefillResult(Message, tag="prefill_result"):
    """Prefill -> decode worker: the prompt's KV is in place.

    `check` is a digest over the prompt's token ids, the written page indices and the first
    token (`handoff_check`); the decode worker recomputes it and refuses a handoff that
    does not match (a stale or mismatched reply). `cached_tokens` counts prompt tokens
    served from each tier (`device`, `host`, `pool`) instead of computed. When the first
    token already ends the request (`finish_reason` set), the prefill worker has sent the
    final chunk itself and the decode worker just frees its reservation.

    `kv_mac` vouches for the KV bytes written (HMAC-SHA256 under the cluster's KV secret
    of the request, prompt, pages and the xxh3-128 of the written bytes; "" when the
    prefill worker has no secret or wrote nothing): a decode worker with a secret decodes
    only when it matches the bytes that landed (worker/handoff/protocol.py, docs/security.md).
    """

    request_id: str
    first_token: int
    check: str
    cached_tokens: dict[str, int] = field(default_factory=dict)
    finish_reason: str | None = None  # set when the first token already ends the request
    kv_mac: str = ""


class RequestStatus(Message, tag="request_status"):
    """Decode worker -> the prefill worker it waits on (`tandem.prefill.<id>.status`): is
    this request still in flight there? "No" while the PrefillResult has not come means
    the reply was lost (e.g. in a NATS restart): the decode worker stops waiting."""

    request_id: str
    router: str = ""  # GenerateRequest.router: the key is (router, request_id)


class RequestStatusReply(Message, tag="request_status_reply"):
    request_id: str
    active: bool


class Usage(Message, tag="usage"):
    """Exact token counts of one request, as the router reports them to the client."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: dict[str, int] = field(default_factory=dict)


class TokenChunk(Message, tag="token_chunk"):
    """Worker -> router on `stream_subject`: tokens `index .. index + len(token_ids) - 1`.

    `text` is the detokenized delta of these tokens, by the engine that sampled them: it
    never ends inside a UTF-8 character and never shows (part of) a stop string, so the
    router concatenates `text` rather than decoding ids itself.
    The last chunk of a request has `finish_reason` ("stop", "length", "abort", "error")
    and `usage`; an error ends the stream with `finish_reason="error"` and `error` set.
    `logprobs[i]` (when asked) is `{"token": id, "logprob": x, "top": [[id, x], ...]}`.
    `prompt_logprobs` (sampling.prompt_logprobs set; on the chunk of token 0 only) are
    entries of the same shape for the prompt tokens from max(prompt_logprobs_from, 1) on,
    each with its "rank" too. `stop_reason` (last chunk, finish_reason "stop"): the stop
    string or stop token id that ended the request; None for EOS or a complete grammar.
    """

    request_id: str
    index: int
    token_ids: list[int]
    worker: str
    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    prompt_logprobs: list[dict[str, Any]] = field(default_factory=list)
    stop_reason: str | int | None = None


class TokenChunkBatch(Message, tag="token_chunk_batch"):
    """Decode worker -> router on `batch_subject`: the chunks one engine step produced for
    every request of that router, in one message. Each chunk is exactly the TokenChunk that
    would otherwise go on its request's `stream_subject` (`request_id` says which).

    One publish, one delivery and one decode per step instead of one per request: at 64
    streams that is most of the router's work per token. Built from encoded chunks by
    `encode_chunk_batch` (a batch is split to stay under the bus's payload limit).
    """

    worker: str
    chunks: list[TokenChunk]


def encode_chunk_batch(worker: str, encoded_chunks: list[bytes]) -> bytes:
    """The bytes of a TokenChunkBatch holding already-encoded TokenChunks (no re-encode:
    the sender measures each chunk's size to split batches under the payload limit)."""
    raw = [msgspec.Raw(c) for c in encoded_chunks]  # written as they are
    # msgspec encodes a Raw as its bytes wherever a TokenChunk is declared.
    return TokenChunkBatch(worker, raw).encode()  # type: ignore[arg-type]


class CancelRequest(Message, tag="cancel"):
    """Router -> every worker (published on `tandem.cancel`): drop this request, free pages.

    `router` is the sender's instance id: a cancel drops only the request that router sent
    (the key is (router, request_id)), never another router's with the same id."""

    request_id: str
    reason: str = "client disconnected"
    router: str = ""


class RouterHeartbeat(Message, tag="router_heartbeat"):
    """Each router process, every `interval` seconds, on `tandem.routers.<router>.heartbeat`.

    `router` is the instance id, random at start-up (GenerateRequest.router); `service_id`
    the router's --service-id, for operators. A worker that hears nothing from a router for
    `timeout` seconds takes it for dead and cancels every request it holds from it (their
    client is gone with it): the router decides its own deadline, workers need no flag.
    """

    router: str
    service_id: str
    interval: float
    timeout: float
    timestamp: float


class RdmaConnect(Message, tag="rdma_connect"):
    """The rdma transport's queue-pair exchange, request and reply alike, on
    `tandem.transfer.<engine-id>.connect` (libs/common/transfer/rdma/exchange.py).

    `exchange` is a QpExchange dict (libs/common/transfer/rdma/link.py), validated there.
    """

    exchange: dict[str, Any]


# --- cluster state: load reports and KV events --------------------------------------------


class LoadReport(Message, tag="load"):
    """Each worker, every few hundred ms, on `tandem.workers.<role>.<id>.load`.

    The router drops a worker whose reports stop (out of rotation within 3 s).
    """

    worker: str
    role: str  # "prefill", "decode" or "both"
    model_id: str
    page_size: int
    kv_dtype: str
    waiting: int
    running: int
    waiting_prefill_tokens: int
    free_pages: int
    total_pages: int
    tokens_per_s: float
    max_model_len: int
    timestamp: float
    # Random per worker process: a worker restarted under the same id reports another one,
    # so the router sees that the process its requests ran on is gone (even if the new one
    # reports before --worker-timeout). Empty from an older worker: not compared.
    instance: str = ""
    # The requests it runs at once at most (--max-num-seqs): the router admits no more than
    # its decode workers' sum. 0 from an older worker: unknown.
    max_running: int = 0
    # What the planner reads (services/planner/policy.py); 0 from an older worker. How long
    # the oldest request waiting in this worker's engine has waited, and the prompt tokens
    # accepted per second since the last report (the arrivals its queue drains).
    queue_time_s: float = 0.0
    prompt_tokens_per_s: float = 0.0
    # Observed over the last few seconds (libs/common/worker/latency.py), 0 with no sample
    # there (or from an older worker): p90 of the time from a request's arrival on this
    # worker to its first token (on a prefill worker, the prompt's share of TTFT), and p90
    # of the time between a stream's tokens (decode).
    ttft_p90_s: float = 0.0
    itl_p90_s: float = 0.0


class KvEvent(Message, tag="kv_event"):
    """A tier change of pages, on `tandem.kv.events.<worker-or-store-id>` (JetStream kept).

    `kind` is `stored` (keys in prefix order, `parent_key` the key before the first, or
    empty), `removed`, or `cleared` (the source holds nothing in `tier` any more). `tier` is
    `device`, `host` or `pool`. `seq` increases per source so a reader can spot gaps.
    """

    source: str
    seq: int
    kind: str
    tier: str
    keys: list[str] = field(default_factory=list)
    parent_key: str = ""
    num_tokens: int = 0
    timestamp: float = 0.0
