"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache.

One forward pass takes the flat tokens of every scheduled sequence (prefill
chunks and decode steps mixed), their positions, and an attention plan built
by the attention backend for this step. Projections are fused (q|k|v and
gate|up) so each layer runs three weight reads instead of seven.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from libs.common.engine.load.gguf import LoadedModel
from libs.common.engine.load.model_config import ModelConfig
from libs.common.engine.model.linear import Linear
from libs.common.engine.model.rope import RotaryEmbedding, inverse_frequencies


class DecoderLayer:
    """Pre-norm attention + SwiGLU MLP with residuals."""

    def __init__(self, config: ModelConfig, w: dict[str, torch.Tensor], index: int) -> None:
        self.index = index
        self.eps = config.rms_norm_eps
        self.attn_norm = w["attn_norm"]
        self.ffn_norm = w["ffn_norm"]
        qkv_bias = None
        if "q_bias" in w:
            qkv_bias = torch.cat([w["q_bias"], w["k_bias"], w["v_bias"]])
        self.qkv = Linear(torch.cat([w["q"], w["k"], w["v"]]), qkv_bias)
        self.o = Linear(w["o"])
        self.gate_up = Linear(torch.cat([w["gate"], w["up"]]))
        self.down = Linear(w["down"])
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.intermediate = config.intermediate_size

    def __call__(self, x, cos, sin, attn, plan) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        hq, hk = self.num_heads, self.num_kv_heads
        h = F.rms_norm(x, (x.shape[-1],), self.attn_norm, self.eps)
        qkv = self.qkv(h)
        # q and k rotate together: one set of RoPE ops per layer instead of two.
        qk = RotaryEmbedding.apply(qkv[:, : (hq + hk) * d].view(t, hq + hk, d), cos, sin)
        q, k = qk[:, :hq], qk[:, hq:]
        v = qkv[:, (hq + hk) * d :].view(t, hk, d)
        o = attn.forward(self.index, q, k, v, plan)
        x = x + self.o(o)
        h = F.rms_norm(x, (x.shape[-1],), self.ffn_norm, self.eps)
        gate, up = self.gate_up(h).split(self.intermediate, dim=-1)
        return x + self.down(F.silu(gate) * up)


class LlamaModel:
    """Inference-only decoder; weights are plain tensors, no autograd.

    Contract: `forward(input_ids [T], positions [T], attn, plan)` writes the
    K/V of those T tokens into their cache slots (through `attn`) and returns
    the final-normed hidden states [T, hidden]; `logits(hidden [N, hidden])`
    returns fp32 logits [N, vocab].
    """

    def __init__(self, loaded: LoadedModel) -> None:
        c = loaded.config
        w = loaded.weights
        self.config = c
        self.model_id = loaded.model_id
        self.embed = w["embed"]
        self.norm = w["norm"]
        self.lm_head = Linear(w.get("lm_head", self.embed))
        self.rope = RotaryEmbedding(inverse_frequencies(c, w.get("rope_freqs")))
        self.layers = []
        for i in range(c.num_layers):
            prefix = f"layers.{i}."
            lw = {k[len(prefix) :]: v for k, v in w.items() if k.startswith(prefix)}
            self.layers.append(DecoderLayer(c, lw, i))

    @torch.inference_mode()
    def forward(self, input_ids, positions, attn, plan) -> torch.Tensor:
        x = self.embed[input_ids]
        cos, sin = self.rope.tables(positions)
        for layer in self.layers:
            x = layer(x, cos, sin, attn, plan)
        return F.rms_norm(x, (x.shape[-1],), self.norm, self.config.rms_norm_eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
