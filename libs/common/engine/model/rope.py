"""Rotary position embeddings in the rotate-half (GPT-NeoX / Hugging Face) layout.

GGUF files of the llama architecture store Q and K rows permuted for llama.cpp's
interleaved RoPE; the GGUF loader undoes that permutation, so every model here
uses this one layout.
"""

from __future__ import annotations

import math

import torch

from libs.common.engine.load.model_config import ModelConfig
from libs.common.engine.model.fused import rope


def inverse_frequencies(
    config: ModelConfig, freq_factors: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-pair inverse frequencies, computed exactly as transformers does (fp32).

    `freq_factors` is a GGUF `rope_freqs` tensor (llama.cpp's form of llama3
    scaling): the frequencies are divided by it, which replaces `rope_scaling`.
    """
    dim = config.head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta**exponent)
    if freq_factors is not None:
        return inv_freq / freq_factors.to(torch.float32)
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1's schedule: long wavelengths are slowed by `factor`, short ones
    # kept, and the band in between interpolated smoothly.
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables grown on demand; `apply` rotates q and k in place-free form.

    Contract: `apply(q, k, positions)` with q [T, Hq, D], k [T, Hk, D] and
    positions [T] (int64) returns the rotated (q, k); the tables cover any
    position (they grow past `max_position` rather than fail).
    """

    def __init__(self, inv_freq: torch.Tensor, initial: int = 4096) -> None:
        self.inv_freq = inv_freq
        self._cos = torch.empty(0)
        self._sin = torch.empty(0)
        self._grow(initial)

    def _grow(self, n: int) -> None:
        pos = torch.arange(n, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = emb.cos(), emb.sin()

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of shape [T, 1, D] for `positions`, shared by every layer of a step."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self._cos.shape[0]:
            self._grow(max(need, 2 * self._cos.shape[0]))
        return self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rope(x, cos, sin)
