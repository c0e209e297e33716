"""A K-quant model end to end (the formats of published Q4_K_M files): its decode steps take
the fused layer over K-quant matrices, with the same bits as the op-by-op path, and its
greedy tokens equal those of the same model dequantized to fp32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from libs.common.engine.config import EngineConfig
from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.load.gguf import load_gguf
from libs.common.engine.load.quantized import FORMATS, QuantWeight
from libs.common.engine.model.fused_decode import FusedDecode
from libs.common.engine.model.model import LlamaModel
from libs.common.engine.step_loop import EngineCore
from tests.engine.conftest import count_fused_runs, run_with_logprobs
from tests.engine.model.tiny_gguf import VOCAB, write_tiny_llama_gguf

gguf = pytest.importorskip("gguf")

# Per layer: q|k|v share a format (one fused product, as the fused layer needs).
LAYER_KINDS = [
    {
        "qkv": "Q4_K",
        "attn_output": "Q4_K",
        "ffn_gate": "Q4_K",
        "ffn_up": "Q4_K",
        "ffn_down": "Q6_K",
    },
    {
        "qkv": "Q5_K",
        "attn_output": "Q6_K",
        "ffn_gate": "Q5_K",
        "ffn_up": "Q5_K",
        "ffn_down": "Q4_K",
    },
]


def sane_blocks(kind: str, rows: int, cols: int, seed: int, std: float = 0.1) -> np.ndarray:
    """Random K-quant blocks of weights centred on 0 with about `std` (random bytes alone
    give Q4_K / Q5_K an offset and Q6_K weights of ~50: activations would saturate).
    Q4_K / Q5_K: each sub-block's min equals its scale (m = sc) and dmin = d times the
    middle quant, so w = d sc (q - middle)."""
    _, block, nbytes = FORMATS[kind]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    spread = {"Q4_K": 143.0, "Q5_K": 285.0, "Q6_K": 1370.0}[kind]  # std of w / d
    d = (
        np.full(data.shape[:2], std / spread, dtype=np.float16)
        .view(np.uint8)
        .reshape(*data.shape[:2], 2)
    )
    if kind == "Q6_K":
        data[:, :, 208:210] = d
    else:
        middle = 7.5 if kind == "Q4_K" else 15.5
        dmin = np.full(data.shape[:2], std / spread * middle, dtype=np.float16)
        data[:, :, 0:2] = d
        data[:, :, 2:4] = dmin.view(np.uint8).reshape(*data.shape[:2], 2)
        data[:, :, 8:12] = data[:, :, 4:8]  # m0-3 and their top bits = sc0-3's
        low = data[:, :, 12:16] & 0x0F
        data[:, :, 12:16] = low | (low << 4)  # m4-7's low nibbles = sc4-7's
    return data.reshape(rows, -1)


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("kquant") / "kquant.gguf"
    layers = [{**kinds, "attn_q": kinds["qkv"], "attn_k": kinds["qkv"], "attn_v": kinds["qkv"]}
              for kinds in LAYER_KINDS]  # fmt: skip
    write_tiny_llama_gguf(
        path, layers, embed_output=("Q4_K", "Q6_K"), blocks=sane_blocks, seeds=(11, 100)
    )
    return str(path)


PROMPTS = [
    torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    for n in (23, 7, 40)
]


def generate(model: LlamaModel, streams: int, speculation: str = "off") -> tuple[dict, dict]:
    """Greedy tokens and log-probabilities; without speculation by default, so that every
    step after the prefill is a plain decode step (the fused layer's case)."""
    torch.set_num_threads(1)
    config = EngineConfig(kv_cache_mb=8, num_threads=1, speculation=speculation)
    core = EngineCore(config, model, None)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3)
    for i, ids in enumerate(PROMPTS[:streams]):
        core.add(str(i), ids, params)
    return run_with_logprobs(core)


@pytest.mark.parametrize("streams", [1, 3])
def test_k_quant_decode_takes_the_fused_layer_with_the_op_by_op_bits(
    kquant_file, monkeypatch, streams
):
    loaded = load_gguf(kquant_file, weights="native")
    assert {w.kind for w in loaded.weights.values() if isinstance(w, QuantWeight)} == {
        "Q4_K",
        "Q5_K",
        "Q6_K",
    }
    model = LlamaModel(loaded)
    assert isinstance(model._fused, FusedDecode), "a K-quant model qualifies"
    calls = count_fused_runs(monkeypatch)
    fused = generate(model, streams)
    assert sum(used for _, used in calls) >= 12, "most decode steps took the fused path"
    monkeypatch.setattr(model, "_fused", None)
    assert generate(model, streams) == fused


def test_k_quant_greedy_tokens_equal_the_dequantized_fp32_models(kquant_file):
    """With the default speculation natively (verification runs the 5-128-row products)."""
    native = generate(LlamaModel(load_gguf(kquant_file, weights="native")), 3, "ngram")[0]
    fp32 = generate(LlamaModel(load_gguf(kquant_file, weights="fp32")), 3)[0]
    assert native == fp32 and all(len(t) == 16 for t in native.values())
    assert len({tuple(t) for t in native.values()}) == 3  # the prompts lead somewhere different
