"""Decode worker flags."""

from dataclasses import dataclass, field

from libs.common.config import WorkerConfig


@dataclass
class DecodeConfig(WorkerConfig):
    """The decode worker: reserves KV pages, receives prompt KV, batches and streams tokens."""

    SERVICE = "decode"

    max_queue_delay: float = field(
        default=30.0,
        metadata={
            "help": "answer 429 when a new prompt would wait longer than this for its "
            "prefill (measured drain rate; 0: never)"
        },
    )
    role: str = field(
        default="decode",
        metadata={
            "help": "decode, or both: also serve prefill for other decode workers (one "
            "process computes prompts and generates: the aggregated setup)",
            "choices": ("decode", "both"),
        },
    )

    def validate(self) -> None:
        super().validate()
        if self.max_queue_delay < 0:
            raise ValueError(f"--max-queue-delay: must be >= 0, got {self.max_queue_delay}")
