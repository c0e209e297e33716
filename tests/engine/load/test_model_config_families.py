"""ModelConfig.from_hf across families: experts, per-head q/k norm, sliding windows."""

from __future__ import annotations

import pytest

from libs.common.engine.load.model_config import ModelConfig

BASE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 32768}  # fmt: skip


def test_qwen3_moe_reads_experts_under_either_key_and_keeps_norm_topk_prob():
    fields = {"model_type": "qwen3_moe", "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    released = ModelConfig.from_hf({**BASE, **fields, "num_experts": 8, "norm_topk_prob": True})
    resaved = ModelConfig.from_hf({**BASE, **fields, "num_local_experts": 8})
    assert (released.num_experts, released.experts_per_token) == (8, 2)
    assert released.expert_intermediate_size == 32 and released.norm_topk_prob
    assert resaved.num_experts == 8 and not resaved.norm_topk_prob
    assert released.qk_norm


def test_mixtral_always_renormalizes_its_top_k_and_counts_only_routed_experts():
    cfg = ModelConfig.from_hf(
        {**BASE, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2}
    )
    assert cfg.norm_topk_prob and cfg.expert_intermediate_size == 128 and not cfg.qk_norm
    dense = ModelConfig.from_hf({**BASE, "model_type": "mistral"})
    # 2 of 8 experts run per token: 2x a dense MLP plus the 8-way router, per layer.
    assert cfg.num_params - dense.num_params == 2 * (3 * 64 * 128 + 8 * 64)


def test_experts_per_token_beyond_num_experts_is_refused_by_name():
    with pytest.raises(ValueError, match="experts_per_token"):
        ModelConfig("mixtral", 256, 64, 128, 2, 4, 2, 16, num_experts=2, experts_per_token=3)


def test_sliding_window_caps_the_context_only_where_the_model_uses_it():
    mistral = ModelConfig.from_hf({**BASE, "model_type": "mistral", "sliding_window": 4096})
    qwen2_off = {**BASE, "model_type": "qwen2", "sliding_window": 4096}
    qwen2_on = {**qwen2_off, "use_sliding_window": True}
    assert mistral.max_position == 4096
    assert ModelConfig.from_hf(qwen2_off).max_position == 32768
    assert ModelConfig.from_hf(qwen2_on).max_position == 4096


def test_unsupported_model_type_is_named_in_the_error():
    with pytest.raises(ValueError, match="'gemma2' is not supported"):
        ModelConfig.from_hf({**BASE, "model_type": "gemma2"})
