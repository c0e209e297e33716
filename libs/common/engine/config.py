"""Settings of one engine instance; validated when built."""

from __future__ import annotations

import dataclasses
from typing import Any

from libs.common.engine.load.gguf import WEIGHT_FORMS
from libs.common.engine.model.attention import BACKENDS

# Flag value -> torch dtype name.
KV_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# How quantized weights' products are chosen (model/kernel_choice.py MODES).
KERNEL_CHOICES = ("measure", "native")
# Speculative decoding's draft sources (engine.spec); "off" verifies nothing.
SPECULATION = ("ngram", "draft", "off")


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
    - `kv_dtype`: the KV cache's element type, "fp32", "bf16" or "fp16" (KV_DTYPES); it is
      part of every page key, so pages of different dtypes never mix, and transfer and
      pool bytes shrink with it. Attention still computes in fp32 (the model's activation
      type): K/V are rounded to `kv_dtype` when written and read back from it. Only the
      torch backend takes a non-fp32 cache for now;
    - `weights`: how the model's matrices are held (gguf.WEIGHT_FORMS): "native" (a
      GGUF's quantized blocks read by the quantized kernels, an HF folder's bf16 as
      bf16), "fp32" (the reference) or "bf16". It changes the KV a model computes, so it
      is part of every page key with the KV dtype (`kv_format`);
    - `kernel_choice`: "measure" (at start-up, time the candidate products of each
      quantized weight's shape per row class and keep the clearly fastest:
      model/kernel_choice.py) or "native" (the built-in paths, nothing timed);
    - `kernel_copy_mb`: memory the measured choice may spend on fp32 copies of quantized
      weights for oneDNN's products (0: none);
    - `speculation`: speculative decoding, "ngram" (drafts by n-gram lookup in the
      request's own tokens, spec/ngram.py), "draft" (drafts by `draft_model`,
      spec/draft.py) or "off" (SPECULATION); greedy output is the same either way, and
      it turns itself off while more sequences run than it pays for and per request
      under low acceptance (spec/speculator.py);
    - `speculation_max_draft`: the most draft tokens verified per request and step;
    - `draft_model`: with speculation "draft" (and only then), the draft model ("default",
      a .gguf file or an HF folder; the target's tokenizer, or start-up fails), its KV
      pool as many tokens as the target's;
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
    kv_dtype: str = "fp32"
    weights: str = "native"
    kernel_choice: str = "measure"
    kernel_copy_mb: int = 0
    speculation: str = "ngram"
    speculation_max_draft: int = 3
    draft_model: str | None = None

    def __post_init__(self) -> None:
        for name in (
            "page_size", "kv_cache_mb", "max_num_seqs", "max_num_batched_tokens",
            "speculation_max_draft",
        ):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.kernel_choice not in KERNEL_CHOICES:
            known = ", ".join(KERNEL_CHOICES)
            raise ValueError(f"kernel_choice must be one of {known}, got {self.kernel_choice!r}")
        if not isinstance(self.kernel_copy_mb, int) or self.kernel_copy_mb < 0:
            raise ValueError(f"kernel_copy_mb must be an int >= 0, got {self.kernel_copy_mb!r}")
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
        if self.kv_dtype not in KV_DTYPES:
            known = ", ".join(KV_DTYPES)
            raise ValueError(f"kv_dtype must be one of {known}, got {self.kv_dtype!r}")
        if self.weights not in WEIGHT_FORMS:
            known = ", ".join(WEIGHT_FORMS)
            raise ValueError(f"weights must be one of {known}, got {self.weights!r}")
        if self.speculation not in SPECULATION:
            known = ", ".join(SPECULATION)
            raise ValueError(f"speculation must be one of {known}, got {self.speculation!r}")
        if (self.speculation == "draft") != bool(self.draft_model):
            raise ValueError(
                "draft_model and speculation 'draft' go together: got speculation "
                f"{self.speculation!r} with draft_model {self.draft_model!r}"
            )
        if self.kv_dtype != "fp32" and self.attention_backend != "torch":
            raise ValueError(
                f"kv_dtype {self.kv_dtype} needs attention_backend torch, got "
                f"{self.attention_backend}"
            )

    @property
    def kv_torch_dtype(self) -> Any:
        import torch  # the config is read without torch (routers, CLIs' --help)

        return getattr(torch, KV_DTYPES[self.kv_dtype])
