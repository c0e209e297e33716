"""Router flags (see docs/routing.md for the routing ones)."""

import dataclasses
import os
from dataclasses import dataclass, field

from libs.common.config import CommonConfig
from libs.common.engine.core.sampling_params import BOUNDS, SamplingError
from libs.common.flags import flag_name, require_positive, require_range


@dataclass
class RouterConfig(CommonConfig):
    """The router: the OpenAI-compatible HTTP API in front of the workers."""

    SERVICE = "router"

    host: str = field(default="127.0.0.1", metadata={"help": "address the HTTP API listens on"})
    port: int = field(default=8000, metadata={"help": "HTTP port (0 picks a free one)"})
    model: str = field(
        default="default",
        metadata={"help": "model whose tokenizer and chat template to use (as the workers')"},
    )
    served_model_name: str = field(
        default="", metadata={"help": "model name clients ask for (default: the --model value)"}
    )
    api_key: str = field(
        default="",
        metadata={
            "help": "require `Authorization: Bearer <key>` or `x-api-key: <key>` (empty: open)"
        },
    )
    api_keys_file: str = field(
        default="",
        metadata={
            "help": "API keys and their tenants: a .toml file of [tenants.<name>] and "
            "[[keys]] hash = 'sha256:<hex>' (any other name: one key or sha256:<hex> a line, "
            "all the default tenant's; docs/security.md)"
        },
    )
    max_pending: int = field(
        default=256,
        metadata={"help": "requests in flight at once; beyond it the API answers 429"},
    )
    max_running: int = field(
        default=0,
        metadata={
            "help": "generations the router runs at once (choices); more wait in the tenants' "
            "fair queues (0: the sum of the live decode workers' reported --max-num-seqs)"
        },
    )
    max_queue_wait: float = field(
        default=10.0,
        metadata={
            "help": "seconds of expected wait in the tenants' queues (tokens ahead / measured "
            "throughput) over which a request is answered 429 with Retry-After at once"
        },
    )
    # Connections (services/router/api/connections.py; docs/security.md, "Connections").
    keepalive_timeout: float = field(
        default=15.0, metadata={"help": "seconds an idle keep-alive connection stays open"}
    )
    header_timeout: float = field(
        default=10.0,
        metadata={
            "help": "seconds from a connection's open (or a request's first byte) to the end "
            "of the request's headers; past it 408 and the connection is closed"
        },
    )
    body_timeout: float = field(
        default=30.0,
        metadata={"help": "seconds for a request's whole body to arrive; past it 408 and close"},
    )
    send_timeout: float = field(
        default=30.0,
        metadata={
            "help": "seconds an answer may wait for a client that has stopped reading; past "
            "it the connection is aborted and the request cancelled"
        },
    )
    max_header_bytes: int = field(
        default=32768,
        metadata={"help": "bytes of a request line and headers together; over it 431"},
    )
    max_headers: int = field(
        default=128, metadata={"help": "header lines of a request; over it 431"}
    )
    max_connections: int = field(
        default=4096,
        metadata={"help": "open connections in all; one more is answered 503 and closed"},
    )
    max_connections_per_address: int = field(
        default=256,
        metadata={"help": "open connections per client address; one more gets 429 and closed"},
    )
    max_n: int = field(
        default=16, metadata={"help": "largest accepted `n`, and prompts x n, per request"}
    )
    # A request's budget before admission (admission/budget.py; docs/api.md "Limits").
    max_body_bytes: int = field(
        default=16 << 20,
        metadata={"help": "largest request body in bytes; beyond it the API answers 413"},
    )
    max_body_items: int = field(
        default=1 << 19,
        metadata={"help": "JSON items (commas) in a body, counted before it is decoded, 400"},
    )
    max_prompt_chars: int = field(
        default=1 << 20,
        metadata={"help": "characters of prompt text per request (prompts or messages), 400"},
    )
    max_prompt_ids: int = field(
        default=1 << 17,
        metadata={"help": "token ids per request given as ids (prompts, /detokenize), 400"},
    )
    max_messages: int = field(
        default=4096, metadata={"help": "messages (or input items) per request, 400"}
    )
    max_generated_tokens: int = field(
        default=1 << 20,
        metadata={"help": "prompts x n x max_tokens per request (unset max_tokens: the context)"},
    )
    cpu_threads: int = field(
        default=1,
        metadata={
            "help": "threads for requests' CPU work (decoding bodies, templates, tokenizing, "
            "formatting); each more one contends with the event loop"
        },
    )
    max_logprob_values: int = field(
        default=1 << 18,
        metadata={"help": "prompts x n x max_tokens x (1 + top logprobs) per request, 400"},
    )
    worker_timeout: float = field(
        default=3.0, metadata={"help": "seconds without a load report before a worker is dropped"}
    )
    worker_forget_timeout: float = field(
        default=30.0,
        metadata={
            "help": "seconds without a load report before a worker dropped from rotation "
            "loses its KV index entries (>= --worker-timeout; one back sooner keeps them)"
        },
    )
    heartbeat_interval: float = field(
        default=0.5, metadata={"help": "seconds between this router's heartbeats to the workers"}
    )
    heartbeat_timeout: float = field(
        default=2.0,
        metadata={
            "help": "seconds without a heartbeat after which workers cancel this router's "
            "requests (at least 2 heartbeat intervals)"
        },
    )
    heartbeat_max_stall: float = field(
        default=30.0,
        metadata={
            "help": "seconds this router's event loop may stall before its workers take it "
            "for hung: a process of its own beats meanwhile (0: beat from the loop only)"
        },
    )
    generate_timeout: float = field(
        default=600.0, metadata={"help": "seconds one request may take end to end"}
    )
    queue_timeout: float = field(
        default=30.0,
        metadata={"help": "seconds a request may wait for room on a full decode worker"},
    )
    prefill_page_weight: float = field(
        default=1.0, metadata={"help": "cost per page a prefill worker must still compute"}
    )
    pool_page_weight: float = field(
        default=0.1, metadata={"help": "cost per page a prefill worker reads from the pool"}
    )
    running_weight: float = field(
        default=1.0, metadata={"help": "cost per running request, in pages (prefill choice)"}
    )
    decode_kv_weight: float = field(
        default=4.0, metadata={"help": "decode cost of a full KV pool, in running requests"}
    )
    disagg_threshold: int = field(
        default=128,
        metadata={"help": "uncached prompt tokens at or below which decode prefills itself"},
    )
    kv_index_max_keys: int = field(
        default=500_000, metadata={"help": "page keys the KV index keeps (LRU beyond)"}
    )
    kv_stream_max_age: float = field(
        default=3600.0, metadata={"help": "seconds the KV events stream keeps events"}
    )
    kv_stream_max_mb: int = field(
        default=256, metadata={"help": "megabytes the KV events stream keeps"}
    )
    responses_ttl: float = field(
        default=30 * 86400.0,
        metadata={"help": "seconds a stored response (POST /v1/responses, store) is kept"},
    )
    responses_max_mb: int = field(
        default=1024,
        metadata={"help": "megabytes of stored responses kept; past it new ones are not stored"},
    )
    # Grammars and tools (services/router/structured/limits.py; docs/security.md).
    grammar_max_chars: int = field(
        default=64 * 1024,
        metadata={"help": "characters of one grammar field as sent (a regex, EBNF, a schema "
                          "as JSON); checked before it is converted"},
    )  # fmt: skip
    grammar_max_rules: int = field(
        default=512, metadata={"help": "rule definitions in one EBNF grammar"}
    )
    max_tools: int = field(default=128, metadata={"help": "tools in one request (OpenAI's 128)"})
    tool_schema_max_chars: int = field(
        default=16 * 1024,
        metadata={"help": "characters of one tool's parameters schema as JSON"},
    )
    grammar_workers: int = field(
        default=2, metadata={"help": "processes that convert and compile grammars"}
    )
    grammar_timeout: float = field(
        default=2.0,
        metadata={"help": "seconds one grammar may take to convert and compile; past it a "
                          "400 (too complex) and its process is replaced"},
    )  # fmt: skip
    # Defaults for sampling fields a request leaves out, over the model's own
    # (services/router/defaults.py has the order). None: not given.
    default_temperature: float | None = field(
        default=None, metadata={"help": "temperature of requests that set none"}
    )
    default_top_p: float | None = field(
        default=None, metadata={"help": "top_p of requests that set none"}
    )
    default_top_k: int | None = field(
        default=None, metadata={"help": "top_k of requests that set none"}
    )
    default_min_p: float | None = field(
        default=None, metadata={"help": "min_p of requests that set none"}
    )
    default_repetition_penalty: float | None = field(
        default=None, metadata={"help": "repetition_penalty of requests that set none"}
    )

    def validate(self) -> None:
        super().validate()
        require_range(self, "port", 0, 65535)
        for name in (
            "max_pending",
            "max_queue_wait",
            "max_n",
            "worker_timeout",
            "worker_forget_timeout",
            "heartbeat_interval",
            "heartbeat_timeout",
            "generate_timeout",
            "queue_timeout",
            "kv_index_max_keys",
            "kv_stream_max_age",
            "kv_stream_max_mb",
            "responses_ttl",
            "responses_max_mb",
            "keepalive_timeout",
            "header_timeout",
            "body_timeout",
            "send_timeout",
            "max_header_bytes",
            "max_headers",
            "max_connections",
            "max_connections_per_address",
            "grammar_max_chars",
            "grammar_max_rules",
            "max_tools",
            "tool_schema_max_chars",
            "grammar_workers",
            "grammar_timeout",
            "max_body_bytes",
            "max_body_items",
            "max_prompt_chars",
            "max_prompt_ids",
            "max_messages",
            "max_generated_tokens",
            "max_logprob_values",
            "cpu_threads",
        ):
            require_positive(self, name)
        if self.heartbeat_max_stall < 0:
            raise ValueError(
                f"--heartbeat-max-stall: must be >= 0, got {self.heartbeat_max_stall:g}"
            )
        if self.worker_forget_timeout < self.worker_timeout:
            raise ValueError(
                f"--worker-forget-timeout: must be at least --worker-timeout "
                f"({self.worker_timeout:g}), got {self.worker_forget_timeout:g}"
            )
        if self.max_running < 0:
            raise ValueError(f"--max-running: must be >= 0, got {self.max_running}")
        if self.heartbeat_timeout < 2 * self.heartbeat_interval:
            raise ValueError(
                f"--heartbeat-timeout: must be at least 2 x --heartbeat-interval "
                f"({2 * self.heartbeat_interval:g}), got {self.heartbeat_timeout:g}"
            )
        for name in ("prefill_page_weight", "pool_page_weight", "running_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{flag_name(name)}: must be >= 0, got {getattr(self, name)}")
        if self.decode_kv_weight < 0:
            raise ValueError(f"--decode-kv-weight: must be >= 0, got {self.decode_kv_weight}")
        if self.disagg_threshold < 0:
            raise ValueError(f"--disagg-threshold: must be >= 0, got {self.disagg_threshold}")
        if not self.model:
            raise ValueError("--model: must not be empty")
        if self.api_keys_file and not os.path.isfile(self.api_keys_file):
            raise ValueError(f"--api-keys-file: no such file: {self.api_keys_file!r}")
        for name, value in self.sampling_flags.items():
            if value is not None:
                try:
                    BOUNDS[name].check(name, value)
                except SamplingError as e:
                    raise ValueError(f"{flag_name(f'default_{name}')}: {e}") from None

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def sampling_flags(self) -> dict[str, int | float | None]:
        """The --default-* flags by sampling field name (None: not given), read from this
        class's fields: a flag is defined once, above (a test checks that they cover the
        fields a model may set, libs/common/engine/load/generation_config.py FIELDS)."""
        return {
            f.name.removeprefix("default_"): getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name.startswith("default_")
        }
