"""The shape of a Llama-family decoder, read from GGUF metadata or config.json."""

from __future__ import annotations

import dataclasses
from typing import Any

# Architectures whose tensors and forward pass this engine implements (config.json's
# `model_type`, GGUF's `general.architecture`). Mistral and SmolLM2 are Llama-shaped;
# Qwen2 adds a bias to the q/k/v projections; Qwen3 RMS-normalizes each q and k head;
# Qwen3-MoE and Mixtral replace the MLP with routed experts.
SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
_QK_NORM_ARCHS = ("qwen3", "qwen3_moe")


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    """Hyper-parameters of one decoder; validated when built.

    `rope_scaling` follows Hugging Face's dict form (`rope_type` "llama3" or
    "linear" with their fields), or None. `eos_token_ids` holds every id that
    ends generation (Llama 3 has several). Mixture-of-experts models set
    `num_experts` (0: dense) and route each token to `experts_per_token` of them,
    each an MLP of `expert_intermediate_size`; `norm_topk_prob` renormalizes the
    chosen experts' router probabilities to sum to 1.
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"arch must be one of {SUPPORTED_ARCHS}, got {self.arch!r}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "linear", "default"):
                raise ValueError(f"rope_scaling type {kind!r} is not supported")
        if self.num_experts:
            if not 1 <= self.experts_per_token <= self.num_experts:
                raise ValueError(
                    f"experts_per_token must be in 1..{self.num_experts}, "
                    f"got {self.experts_per_token}"
                )
            if self.expert_intermediate_size < 1:
                raise ValueError(
                    f"expert_intermediate_size must be >= 1, got {self.expert_intermediate_size}"
                )

    @property
    def qk_norm(self) -> bool:
        """Whether each q and k head is RMS-normalized (own weights) before RoPE."""
        return self.arch in _QK_NORM_ARCHS

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        """Weights that take part in matrix products per token (lm_head counted once);
        for a mixture of experts, the router and the experts one token runs, in every layer."""
        attn = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        if self.num_experts:
            routed = self.experts_per_token * 3 * self.hidden_size * self.expert_intermediate_size
            mlp = routed + self.num_experts * self.hidden_size
        return self.num_layers * (attn + mlp) + self.vocab_size * self.hidden_size

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face config.json dict."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_ARCHS:
            raise ValueError(
                f"model_type {model_type!r} is not supported (supported: {SUPPORTED_ARCHS})"
            )
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        # transformers >= 5 writes `rope_parameters` {rope_theta, rope_type, ...}; older
        # config.json files have `rope_theta` and `rope_scaling` at the top level.
        rope = cfg.get("rope_parameters") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        return cls(
            arch=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(theta),
            max_position=_context_from_hf(model_type, cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **_experts_from_hf(model_type, cfg),
        )


def _experts_from_hf(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The routed-experts fields of a Qwen3-MoE or Mixtral config.json; {} when dense."""
    if model_type == "mixtral":
        return {
            "num_experts": cfg["num_local_experts"],
            "experts_per_token": cfg["num_experts_per_tok"],
            "expert_intermediate_size": cfg["intermediate_size"],
            "norm_topk_prob": True,  # Mixtral always renormalizes the top-k
        }
    if model_type == "qwen3_moe":
        # Released checkpoints write `num_experts`; transformers >= 5 saves `num_local_experts`.
        return {
            "num_experts": cfg.get("num_experts") or cfg.get("num_local_experts", 0),
            "experts_per_token": cfg["num_experts_per_tok"],
            "expert_intermediate_size": cfg["moe_intermediate_size"],
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        }
    return {}


def _context_from_hf(model_type: str, cfg: dict[str, Any]) -> int:
    """max_position_embeddings, capped at the sliding window where the model uses one.

    Sliding-window attention is not implemented; within the window it equals full
    attention, so a windowed model (Mistral 7B v0.1, Qwen2 with use_sliding_window)
    serves contexts up to the window and no further.
    """
    context = cfg.get("max_position_embeddings", 4096)
    window = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window"):
        window = None
    return min(context, window) if window else context
