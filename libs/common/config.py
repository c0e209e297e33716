"""Service configuration: one dataclass per service, every field a flag and an env variable.

A field `nats_url` of the router's config is, in order of precedence:

    --nats-url VALUE            (command line)
    TANDEM_ROUTER_NATS_URL      (environment, this service only)
    TANDEM_NATS_URL             (environment, every service)
    the dataclass default

Per-service variables let one `.env` file configure a whole cluster (`TANDEM_ROUTER_PORT`
next to `TANDEM_PREFILL_MAX_NUM_SEQS`), while shared ones (`TANDEM_NATS_URL`) need saying once.

Fields carry their help text in `field(metadata={"help": ...})`; `choices` may be given
too. Validation happens in `__post_init__` (see `CommonConfig.validate`) and raises
`ValueError` naming the flag, so a bad value from any source reads the same to an operator.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from libs.common.flags import (
    build_parser,
    convert,
    env_names,
    flag_name,
    init_fields,
    require_positive,
    require_range,
)

_ID_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
_LOG_LEVELS = ("debug", "info", "warning", "error")
_LOG_FORMATS = ("auto", "json", "console")

C = TypeVar("C", bound="CommonConfig")


def redact_url(url: str) -> str:
    """`nats://user:secret@host:4222` -> `nats://user:***@host:4222` (each of a list)."""
    hide = re.compile(r"^(\w+://[^:/@]*):[^@/]*@")
    return ",".join(hide.sub(r"\1:***@", u.strip()) for u in url.split(","))


def _default_service_id(service: str) -> str:
    host = re.sub(r"[^a-z0-9-]", "-", socket.gethostname().lower())[:40].strip("-") or "host"
    return f"{service}-{host}-{os.getpid()}"


@dataclass
class CommonConfig:
    """Flags every service has. Subclasses add their own fields and set `SERVICE`."""

    SERVICE = "common"

    nats_url: str = field(
        default="nats://127.0.0.1:4222",
        metadata={"help": "NATS server URL(s), comma-separated for a cluster"},
    )
    nats_credentials_file: str = field(
        default="",
        metadata={
            "help": "file holding this service's NATS identity, one line user:password "
            "(unset: none, or the URL's userinfo; docs/security.md, 'Bus identities')"
        },
    )
    service_id: str = field(
        default="",
        metadata={"help": "unique id of this instance (default: <service>-<host>-<pid>)"},
    )
    subject_prefix: str = field(
        default="tandem", metadata={"help": "prefix of every NATS subject Tandem uses"}
    )
    log_level: str = field(default="info", metadata={"help": "log level", "choices": _LOG_LEVELS})
    log_format: str = field(
        default="auto",
        metadata={
            "help": "json lines, console, or auto (console on a TTY, json otherwise)",
            "choices": _LOG_FORMATS,
        },
    )
    event_loop: str = field(
        default="uvloop",
        metadata={
            "help": "uvloop (faster NATS and socket wake-ups) or asyncio's own loop",
            "choices": ("uvloop", "asyncio"),
        },
    )
    connect_timeout: float = field(
        default=10.0, metadata={"help": "seconds to keep trying the first NATS connection"}
    )
    request_timeout: float = field(
        default=5.0, metadata={"help": "default timeout of NATS requests, seconds"}
    )
    drain_timeout: float = field(
        default=10.0,
        metadata={"help": "on SIGTERM, seconds to let in-flight work finish before exiting"},
    )
    otlp_endpoint: str = field(
        default="",
        metadata={
            "help": "OpenTelemetry collector (OTLP/HTTP, e.g. http://jaeger:4318) that gets "
            "one trace per request; unset: OTEL_EXPORTER_OTLP_ENDPOINT, else tracing off "
            "(docs/operations.md, 'Traces')"
        },
    )

    def __post_init__(self) -> None:
        if not self.service_id:
            self.service_id = _default_service_id(self.SERVICE)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the flag of the first bad value. Subclasses extend it."""
        urls = [u.strip() for u in self.nats_url.split(",") if u.strip()]
        if not urls or not all(re.match(r"^(nats|tls|ws|wss)://[^\s]+$", u) for u in urls):
            raise ValueError(f"--nats-url: expected nats://host:port, got {self.nats_url!r}")
        if not _ID_RE.match(self.service_id):
            raise ValueError(
                f"--service-id: {self.service_id!r} must be 1-64 of [a-z0-9_-], "
                "starting with a letter or digit (it becomes part of NATS subjects)"
            )
        if not re.match(r"^[a-z][a-z0-9_-]*$", self.subject_prefix):
            raise ValueError(f"--subject-prefix: {self.subject_prefix!r} is not a valid token")
        for name in ("connect_timeout", "request_timeout", "drain_timeout"):
            require_positive(self, name)
        if self.otlp_endpoint and not re.match(r"^https?://[^\s]+$", self.otlp_endpoint):
            raise ValueError(
                f"--otlp-endpoint: expected http(s)://host:port, got {self.otlp_endpoint!r}"
            )
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(
                    f"{flag_name(f.name)}: {getattr(self, f.name)!r} is not one of {list(choices)}"
                )

    @classmethod
    def parse(
        cls: type[C], argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
    ) -> C:
        """Build the config from argv and env (defaults: sys.argv[1:] and os.environ).

        `--help` exits 0 after printing every flag with its variables and default;
        a bad value exits 2 with the flag named (argparse's convention).
        """
        env = os.environ if env is None else env
        parser = build_parser(cls)
        args = parser.parse_args(argv)
        values: dict[str, Any] = {}
        for f in init_fields(cls):
            cli = getattr(args, f.name)
            if cli is not None:
                values[f.name] = cli
                continue
            for var in env_names(cls.SERVICE, f.name):
                if var in env:
                    try:
                        values[f.name] = convert(cls, f, env[var])
                    except ValueError as e:
                        parser.error(f"{flag_name(f.name)} (from ${var}): {e}")
                    break
        try:
            return cls(**values)
        except ValueError as e:
            parser.error(str(e))
            raise  # unreachable: parser.error exits


@dataclass
class TransferConfig(CommonConfig):
    """Flags of a service that owns a transfer engine (the workers, the cache stores)."""

    transport: str = field(
        default="auto",
        metadata={
            "help": "KV transfer transport; auto = rdma where a device exists, else tcp",
            "choices": ("auto", "rdma", "tcp", "shm"),
        },
    )
    transfer_host: str = field(
        default="127.0.0.1",
        metadata={"help": "address the transfer engine listens on and gives to peers"},
    )
    transfer_advertise_host: str = field(
        default="",
        metadata={"help": "address peers dial for KV transfers (default: --transfer-host)"},
    )
    transfer_stall_timeout: float = field(
        default=10.0,
        metadata={"help": "seconds a KV transfer connection may stall before it fails (tcp)"},
    )
    transfer_first_frame_timeout: float = field(
        default=10.0,
        metadata={"help": "seconds a new transfer connection has to send an admitted op (tcp)"},
    )
    transfer_frame_timeout: float = field(
        default=10.0,
        metadata={"help": "seconds a started transfer frame may take, +1 s per MiB (tcp)"},
    )
    transfer_max_connections_per_ip: int = field(
        default=64,
        metadata={"help": "transfer server connections one source IP may hold (tcp)"},
    )

    def validate(self) -> None:
        super().validate()
        require_positive(self, "transfer_stall_timeout")
        require_range(self, "transfer_first_frame_timeout", 0.01, 3600)
        require_range(self, "transfer_frame_timeout", 0.01, 3600)
        require_range(self, "transfer_max_connections_per_ip", 1, 256)

    def transfer_options(self, transport: str) -> dict[str, Any]:
        """create_engine keywords from these flags for `transport` (shm and rdma take
        none of them; rdma's exchange options come from transfer_exchange)."""
        if transport != "tcp":
            return {}
        return {
            "host": self.transfer_host,
            "advertise_host": self.transfer_advertise_host or None,
            "stall_timeout_s": self.transfer_stall_timeout,
            "first_frame_timeout_s": self.transfer_first_frame_timeout,
            "frame_timeout_s": self.transfer_frame_timeout,
            "max_connections_per_ip": self.transfer_max_connections_per_ip,
        }


@dataclass
class WorkerConfig(TransferConfig):
    """Flags shared by the model workers (prefill and decode)."""

    model: str = field(
        default="default",
        metadata={"help": "'default' (SmolLM2-135M-Instruct Q4_1), a GGUF file or an HF folder"},
    )
    page_size: int = field(default=16, metadata={"help": "tokens per KV page"})
    kv_cache_mb: int = field(default=512, metadata={"help": "memory of the paged KV pool, MiB"})
    max_num_seqs: int = field(default=64, metadata={"help": "cap on running requests"})
    max_num_batched_tokens: int = field(
        default=512, metadata={"help": "tokens per engine step (the prefill chunk size)"}
    )
    num_threads: int = field(
        default=0, metadata={"help": "torch threads for the model (0: one per core)"}
    )
    no_prefix_cache: bool = field(
        default=False, metadata={"help": "turn the worker's own prefix cache (L1) off"}
    )
    no_pool: bool = field(
        default=False, metadata={"help": "do not read from or write to the KV pool (L3)"}
    )
    kv_secret_file: str = field(
        default="",
        metadata={
            "help": "file holding the cluster's KV secret: pool objects are MAC-tagged "
            "with it and only tags it verifies are read; prefill workers MAC the KV they "
            "hand to decode workers, which decode only KV that verifies (unset: both "
            "off, logged; docs/security.md)"
        },
    )
    no_decode_mirror: bool = field(
        default=False,
        metadata={"help": "no dense K/V copy of decoding sequences (up to --kv-cache-mb again)"},
    )
    kv_dtype: str = field(
        default="fp32",
        metadata={"help": "KV cache element type: fp32, bf16 or fp16 (half the bytes to move)"},
    )
    weights: str = field(
        default="native",
        metadata={
            "help": "how the model's matrices are held: native (a GGUF's quantized blocks, "
            "read by the quantized kernels), fp32 (the reference) or bf16",
            "choices": ("native", "fp32", "bf16"),
        },
    )
    kernel_choice: str = field(
        default="measure",
        metadata={
            "help": "measure: at start-up time each quantized weight shape's candidate "
            "products per batch size class and keep the clearly fastest; native: the "
            "built-in kernels, nothing timed",
            "choices": ("measure", "native"),
        },
    )
    kernel_copy_mb: int = field(
        default=0,
        metadata={
            "help": "MiB the measured choice may spend on fp32 copies of quantized "
            "weights for oneDNN (0: none)"
        },
    )
    speculation: str = field(
        default="ngram",
        metadata={
            "help": "speculative decoding: ngram (drafts from the request's own tokens, "
            "verified in one step; same greedy output, off by itself with 2+ streams "
            "or low acceptance), draft (drafts by --draft-model) or off",
            "choices": ("ngram", "draft", "off"),
        },
    )
    draft_model: str = field(
        default="",
        metadata={"help": "with --speculation draft: a small model of the same tokenizer "
                  "that drafts ('default', a GGUF file or an HF folder)"},
    )  # fmt: skip
    speculation_max_draft: int = field(
        default=3, metadata={"help": "draft tokens verified per request and step at most"}
    )
    load_interval: float = field(default=0.25, metadata={"help": "seconds between load reports"})
    handoff_timeout: float = field(
        default=300.0,
        metadata={"help": "seconds a KV handoff (queueing included) may take at most"},
    )
    peer_timeout: float = field(
        default=3.0,
        metadata={"help": "seconds without load reports after which a peer worker is dead"},
    )

    def validate(self) -> None:
        super().validate()
        for name in (
            "page_size", "kv_cache_mb", "max_num_seqs", "max_num_batched_tokens",
            "speculation_max_draft",
        ):  # fmt: skip
            require_positive(self, name)
        for name in ("load_interval", "handoff_timeout", "peer_timeout"):
            require_positive(self, name)
        if self.num_threads < 0:
            raise ValueError(f"--num-threads: must be >= 0, got {self.num_threads}")
        if self.kernel_copy_mb < 0:
            raise ValueError(f"--kernel-copy-mb: must be >= 0, got {self.kernel_copy_mb}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("--max-num-batched-tokens: must be >= --max-num-seqs")
        if (self.speculation == "draft") != bool(self.draft_model):
            raise ValueError("--draft-model: set it with --speculation draft, and only then")
