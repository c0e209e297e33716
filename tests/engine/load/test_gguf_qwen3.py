"""A Qwen3 GGUF (written here from a tiny random transformers model) loads its per-head
q/k norms and matches transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.load.gguf import load_gguf
from libs.common.engine.model.model import LlamaModel
from tests.engine.model.test_families import SHAPE, make_core

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

# llama.cpp's tensor names for one Qwen3 layer (its converter keeps q/k rows as they are).
LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down"}  # fmt: skip


def gguf_name(hf: str) -> str:
    hf = hf.removesuffix(".weight")
    if hf.startswith("model.layers."):
        index, _, rest = hf[len("model.layers.") :].partition(".")
        return f"blk.{index}.{LAYER[rest]}.weight"
    return {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
            "lm_head": "output"}[hf] + ".weight"  # fmt: skip


def write_qwen3_gguf(path, model) -> None:
    c = model.config
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    for name, tensor in model.state_dict().items():
        writer.add_tensor(gguf_name(name), tensor.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_qwen3_gguf_logits_within_1e4_relative_of_transformers(tmp_path):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.Qwen3Config(**SHAPE, head_dim=16)
    reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    write_qwen3_gguf(tmp_path / "qwen3.gguf", reference.eval())
    loaded = load_gguf(str(tmp_path / "qwen3.gguf"))
    assert loaded.config.arch == "qwen3" and "layers.0.q_norm" in loaded.weights
    core = make_core(LlamaModel(loaded), None)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    core.add("0", ids, SamplingParams(max_tokens=1, temperature=0))
    sched = core.scheduler.schedule()
    ours = core.model.logits(core.runner.forward(sched.scheduled))[0]
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0, -1].float()
    rel = float((ours - ref).abs().max() / ref.abs().max())
    assert rel < 1e-4, f"relative error {rel:.2e}"
