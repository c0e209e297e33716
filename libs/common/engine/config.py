"""Settings of one engine instance; validated when built."""

from __future__ import annotations

import dataclasses

from libs.common.engine.model.attention import BACKENDS


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    """What an Engine is built from. A bad value raises ValueError naming the field.

    - `model`: "default", a .gguf file or a Hugging Face folder;
    - `kv_cache_mb`: memory of the paged KV pool (or `num_pages` to set it exactly);
    - `max_num_batched_tokens`: the per-step token budget (prefill chunk size);
    - `max_num_seqs`: cap on running requests;
    - `num_threads`: torch intra-op threads (None: leave torch's choice);
    - `decode_mirror`: the torch backend keeps a dense copy of the decoding sequences'
      K/V (at most the KV pool's size again) so decode attention gathers no pages;
    - `worker_id` / `tier`: how KV events name this cache.
    """

    model: str = "default"
    device: str = "cpu"
    attention_backend: str = "torch"
    page_size: int = 16
    kv_cache_mb: int = 1024
    num_pages: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_cache: bool = True
    num_threads: int | None = None
    decode_mirror: bool = True
    tier: str = "L1"

    def __post_init__(self) -> None:
        for name in ("page_size", "kv_cache_mb", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("num_pages", "num_threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if self.attention_backend not in {n for n, _ in BACKENDS}:
            raise ValueError(f"attention_backend {self.attention_backend!r} is not known")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        if not self.model:
            raise ValueError("model must not be empty")
