"""Decode worker flags."""

from dataclasses import dataclass

from libs.common.config import WorkerConfig


@dataclass
class DecodeConfig(WorkerConfig):
    """The decode worker: reserves KV pages, receives prompt KV, batches and streams tokens."""

    SERVICE = "decode"
