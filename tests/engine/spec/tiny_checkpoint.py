"""Tiny random Llama checkpoints (Hugging Face folders) that carry a given tokenizer, for
draft-model tests: with the default model's tokenizer they share its 49,152-token
vocabulary at a few thousand times fewer parameters in the layers.

Written as config.json, model.safetensors (fp32, random from `seed`; norms near 1, the
output head untied) and tokenizer.json (the `tokenizers` object of the given
TextTokenizer, saved as it is), the folder form our loader reads (load/hf.py).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import torch
from safetensors.torch import save_file

from libs.common.engine.load.tokenizer import TextTokenizer


@dataclasses.dataclass(frozen=True)
class TinyShape:
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 128
    seed: int = 0


def write_tiny_checkpoint(
    folder: pathlib.Path, shape: TinyShape, tokenizer: TextTokenizer
) -> pathlib.Path:
    """The checkpoint of `shape` in `folder` (created); returns `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = tokenizer.vocab_size
    config = {
        "model_type": "llama", "vocab_size": vocab, "hidden_size": shape.hidden,
        "intermediate_size": shape.ffn, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": list(tokenizer.eos_token_ids),
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer.tokenizer.save(str(folder / "tokenizer.json"))
    g = torch.Generator().manual_seed(shape.seed)

    def matrix(rows: int, cols: int, scale: float | None = None) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * (scale or cols**-0.5)

    def norm() -> torch.Tensor:
        return 0.5 + torch.rand(shape.hidden, generator=g)

    kv = shape.kv_heads * (shape.hidden // shape.heads)
    tensors = {
        "model.embed_tokens.weight": matrix(vocab, shape.hidden, 1.0),
        "lm_head.weight": matrix(vocab, shape.hidden),
        "model.norm.weight": norm(),
    }
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": norm(),
            p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": matrix(shape.hidden, shape.hidden),
            p + "self_attn.k_proj.weight": matrix(kv, shape.hidden),
            p + "self_attn.v_proj.weight": matrix(kv, shape.hidden),
            p + "self_attn.o_proj.weight": matrix(shape.hidden, shape.hidden),
            p + "mlp.gate_proj.weight": matrix(shape.ffn, shape.hidden),
            p + "mlp.up_proj.weight": matrix(shape.ffn, shape.hidden),
            p + "mlp.down_proj.weight": matrix(shape.hidden, shape.ffn),
        }
    save_file(tensors, str(folder / "model.safetensors"))
    return folder
