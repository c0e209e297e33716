"""Load a Hugging Face model folder: config.json, *.safetensors, tokenizer files.

torch is imported by `load_hf_folder` alone: importing this module stays torch-free.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import TYPE_CHECKING

from libs.common.engine.load.gguf import WEIGHT_FORMS, LoadedModel
from libs.common.engine.load.model_config import ModelConfig

if TYPE_CHECKING:
    import torch

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.o_proj.weight": "o",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
    "mlp.gate.weight": "router",  # Qwen3-MoE
    "block_sparse_moe.gate.weight": "router",  # Mixtral
}
# Routed experts, one MLP each: Qwen3-MoE's mlp.experts.{j}.{gate,up,down}_proj and
# Mixtral's block_sparse_moe.experts.{j}.{w1,w3,w2} (gate, up, down).
_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_EXPERT_NAMES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down",
                 "w1": "gate", "w3": "up", "w2": "down"}  # fmt: skip
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "norm",
    "lm_head.weight": "lm_head",
}


def load_hf_folder(path: str, weights: str = "fp32") -> LoadedModel:
    """Read config.json and every *.safetensors shard.

    `weights` (WEIGHT_FORMS): "fp32" makes every tensor fp32; "bf16" rounds the matrices
    to bf16; "native" keeps bf16 matrices as stored and makes the rest fp32. Norms and
    biases are always fp32.
    """
    import torch
    from safetensors import safe_open

    if weights not in WEIGHT_FORMS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMS)}, got {weights!r}")
    form = weights
    folder = pathlib.Path(path)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"model: {path} has no config.json")
    config = ModelConfig.from_hf(json.loads(config_path.read_text()))
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"model: {path} has no *.safetensors files")
    weights_by_name: dict[str, torch.Tensor] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                name = _canonical(key)
                if name is not None:
                    weights_by_name[name] = _held(f.get_tensor(key), name, form, torch)
    if config.tie_word_embeddings:
        weights_by_name.pop("lm_head", None)
    meta: dict = {"hf_folder": str(folder)}
    return LoadedModel(config, weights_by_name, meta, model_id=folder.name, weight_form=form)


def _held(tensor: torch.Tensor, name: str, form: str, torch) -> torch.Tensor:
    matrix = tensor.dim() == 2 and not name.endswith(("norm", "bias"))
    if matrix and (form == "bf16" or (form == "native" and tensor.dtype == torch.bfloat16)):
        return tensor.to(torch.bfloat16).contiguous()
    return tensor.to(torch.float32).contiguous()


def _canonical(key: str) -> str | None:
    if key in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[key]
    if key.startswith("model.layers."):
        index, _, rest = key[len("model.layers.") :].partition(".")
        if rest in _LAYER_NAMES:
            return f"layers.{index}.{_LAYER_NAMES[rest]}"
        expert = _EXPERT.fullmatch(rest)
        if expert and expert[2] in _EXPERT_NAMES:
            return f"layers.{index}.experts.{expert[1]}.{_EXPERT_NAMES[expert[2]]}"
    return None
