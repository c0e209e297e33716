"""Attention backends by name, imported only when asked for.

`torch` runs anywhere (the CPU path and the reference); `flashinfer` and
`triton` need CUDA and are never imported on a machine without it.
"""

from __future__ import annotations

import importlib

from libs.common.engine.model.attention.base import AttentionBackend, AttentionBatch

__all__ = ["BACKENDS", "AttentionBackend", "AttentionBatch", "backend_class"]

# name -> (module, class); a tuple of pairs so nothing here is mutable.
BACKENDS = (
    ("torch", ("libs.common.engine.model.attention.torch_backend", "TorchAttention")),
    (
        "flashinfer",
        ("libs.common.engine.model.attention.flashinfer_backend", "FlashInferAttention"),
    ),
    ("triton", ("libs.common.engine.model.attention.triton_backend", "TritonAttention")),
)


def backend_class(name: str) -> type[AttentionBackend]:
    """The backend class called `name`; ValueError naming the choices otherwise."""
    for known, (module, cls) in BACKENDS:
        if known == name:
            return getattr(importlib.import_module(module), cls)
    choices = ", ".join(n for n, _ in BACKENDS)
    raise ValueError(f"attention_backend must be one of {choices}, got {name!r}")
