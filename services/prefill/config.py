"""Prefill worker flags."""

from dataclasses import dataclass

from libs.common.config import WorkerConfig


@dataclass
class PrefillConfig(WorkerConfig):
    """The prefill worker: computes prompts and writes their KV into a decode worker's pages."""

    SERVICE = "prefill"
