"""Decode worker flags."""

from dataclasses import dataclass, field

from libs.common.config import WorkerConfig


@dataclass
class DecodeConfig(WorkerConfig):
    """The decode worker: reserves KV pages, receives prompt KV, batches and streams tokens."""

    SERVICE = "decode"

    role: str = field(
        default="decode",
        metadata={
            "help": "decode, or both: also serve prefill for other decode workers (one "
            "process computes prompts and generates: the aggregated setup)",
            "choices": ("decode", "both"),
        },
    )
