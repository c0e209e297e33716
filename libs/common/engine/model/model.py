"""A Llama-family decoder over a paged KV cache.

Families (config `arch`): Llama 2/3 (with Llama 3.1's RoPE scaling), SmolLM2,
Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head RMSNorm of q and k before RoPE),
and the mixtures of experts Qwen3-MoE and Mixtral (the MLP replaced by routed
experts). Each is checked against transformers in tests/engine/model/test_families.py.

One forward pass takes the flat tokens of every scheduled sequence (prefill
chunks and decode steps mixed), their positions, and an attention plan built
by the attention backend for this step. Projections are fused (q|k|v and
gate|up) so each layer runs three weight reads instead of seven. Activations are fp32;
the matrices are fp32, bf16 or GGUF quantized blocks (model/linear.py multiplies each
form), as the loader's `weight_form` says.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from libs.common.engine.load.gguf import LoadedModel
from libs.common.engine.load.model_config import ModelConfig
from libs.common.engine.load.quantized import QuantWeight
from libs.common.engine.model.fused import add_rms_norm, rms_norm, swiglu
from libs.common.engine.model.fused_decode import FusedDecode
from libs.common.engine.model.linear import fused_linear, make_linear
from libs.common.engine.model.quant.ops import rows
from libs.common.engine.model.rope import RotaryEmbedding, inverse_frequencies


class DenseMLP:
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate|up as one product."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        self.size = gate.shape[0]
        self.gate_up = fused_linear([gate, up])
        self.down = make_linear(down)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(swiglu(self.gate_up(x), self.size))


class RoutedExperts:
    """A mixture of experts: each token runs the `top_k` experts its router rates highest.

    The router's softmax over all experts gives the weights of the chosen ones;
    `renormalize` rescales those to sum to 1 (Mixtral always, Qwen3-MoE when its
    config sets norm_topk_prob). The output is the weighted sum of the chosen
    experts' outputs. Each expert runs once per step, on the rows that chose it.
    """

    def __init__(
        self, router: torch.Tensor, experts: list[DenseMLP], top_k: int, renormalize: bool
    ) -> None:
        self.router = make_linear(router)
        self.experts = experts
        self.top_k = top_k
        self.renormalize = renormalize

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for expert in chosen.unique().tolist():
            rows, rank = (chosen == expert).nonzero(as_tuple=True)
            y = self.experts[expert](x[rows]) * weights[rows, rank, None]
            out.index_add_(0, rows, y)
        return out


def build_mlp(config: ModelConfig, w: dict[str, torch.Tensor]) -> DenseMLP | RoutedExperts:
    """The layer's MLP: routed experts when its weights hold a router, else dense SwiGLU.

    Chosen per layer, so a Qwen3-MoE with dense layers (mlp_only_layers) loads too.
    """
    if "router" not in w:
        return DenseMLP(w["gate"], w["up"], w["down"])
    if "experts.0.gate" not in w:
        raise ValueError(
            "model: a routed layer without per-expert weights experts.{j}.gate/up/down "
            "(fused expert tensors are not supported)"
        )
    experts = [
        DenseMLP(w[f"experts.{j}.gate"], w[f"experts.{j}.up"], w[f"experts.{j}.down"])
        for j in range(config.num_experts)
    ]
    return RoutedExperts(w["router"], experts, config.experts_per_token, config.norm_topk_prob)


class DecoderLayer:
    """Pre-norm attention + MLP (dense or routed experts) with residuals."""

    def __init__(self, config: ModelConfig, w: dict[str, torch.Tensor], index: int) -> None:
        self.index = index
        self.eps = config.rms_norm_eps
        self.attn_norm = w["attn_norm"]
        self.ffn_norm = w["ffn_norm"]
        qkv_bias = None
        if "q_bias" in w:
            qkv_bias = torch.cat([w["q_bias"], w["k_bias"], w["v_bias"]])
        self.qkv = fused_linear([w["q"], w["k"], w["v"]], qkv_bias)
        self.o = make_linear(w["o"])
        self.mlp = build_mlp(config, w)
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        # Qwen3: every q head is RMS-normalized with q_norm [head_dim], every k head with
        # k_norm; stacked [Hq + Hk, head_dim] so q and k normalize in one call.
        self.qk_norm = None
        if config.qk_norm:
            hq, hk = self.num_heads, self.num_kv_heads
            self.qk_norm = torch.cat([w["q_norm"].expand(hq, -1), w["k_norm"].expand(hk, -1)])

    def __call__(self, x, cos, sin, attn, plan) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        hq, hk = self.num_heads, self.num_kv_heads
        h = rms_norm(x, self.attn_norm, self.eps)
        qkv = self.qkv(h)
        qk = qkv[:, : (hq + hk) * d].view(t, hq + hk, d)
        if self.qk_norm is not None:
            qk = F.rms_norm(qk, (d,), eps=self.eps) * self.qk_norm
        # q and k rotate together: one set of RoPE ops per layer instead of two.
        qk = RotaryEmbedding.apply(qk, cos, sin)
        q, k = qk[:, :hq], qk[:, hq:]
        v = qkv[:, (hq + hk) * d :].view(t, hk, d)
        o = attn.forward(self.index, q, k, v, plan)
        x, h = add_rms_norm(x, self.o(o), self.ffn_norm, self.eps)
        return x + self.mlp(h)


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
        self.weight_form = loaded.weight_form
        self.embed = w["embed"]
        self.norm = w["norm"]
        self.lm_head = make_linear(w.get("lm_head", self.embed))
        self.rope = RotaryEmbedding(inverse_frequencies(c, w.get("rope_freqs")))
        self.layers = []
        for i in range(c.num_layers):
            prefix = f"layers.{i}."
            lw = {k[len(prefix) :]: v for k, v in w.items() if k.startswith(prefix)}
            self.layers.append(DecoderLayer(c, lw, i))
        self._fused = FusedDecode.build(self)

    @torch.inference_mode()
    def forward(self, input_ids, positions, attn, plan) -> torch.Tensor:
        x = self._embed(input_ids)
        cos, sin = self.rope.tables(positions)
        if self._fused is None or not self._fused.run(x, cos, sin, attn, plan):
            for layer in self.layers:
                x = layer(x, cos, sin, attn, plan)
        return rms_norm(x, self.norm, self.config.rms_norm_eps)

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads (every product once; the embedding rows
        looked up are negligible): the single-stream memory floor's numerator."""
        total = self.lm_head.nbytes
        for layer in self.layers:
            mlp = layer.mlp
            parts = [mlp.gate_up, mlp.down] if isinstance(mlp, DenseMLP) else [mlp.router]
            if not isinstance(mlp, DenseMLP):  # routed: top_k experts' worth per token
                per_expert = mlp.experts[0].gate_up.nbytes + mlp.experts[0].down.nbytes
                total += mlp.top_k * per_expert
            total += layer.qkv.nbytes + layer.o.nbytes + sum(p.nbytes for p in parts)
        return total

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, QuantWeight):
            return rows(self.embed, input_ids)
        return self.embed[input_ids].float()

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
