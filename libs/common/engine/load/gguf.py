"""Load a GGUF file: config, weights, tokenizer metadata.

Supported tensor types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K (others are
refused by name). Weights come in one of three forms (`WEIGHT_FORMS`, the engine's
--weights): "native" keeps every quantized matrix as its blocks (a `QuantWeight`, read by
the quantized kernels) and the rest fp32; "fp32" dequantizes everything (the reference);
"bf16" dequantizes and rounds the matrices to bf16 (norms and biases stay fp32).

llama.cpp's converter permutes the rows of Q and K for the llama architecture so that
its interleaved RoPE works on them; `unpermute_qk` undoes that (on blocks too: it moves
whole rows), and the model then applies rotate-half RoPE like transformers does
(tests/engine/load/test_gguf.py proves the two forms equal).

Config and tokenizer metadata read without torch (the router needs them, never the
weights); torch is imported by `load_gguf` alone.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import numpy as np
import structlog

from libs.common.engine.load.model_config import ModelConfig

log = structlog.get_logger(__name__)

_SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
WEIGHT_FORMS = ("native", "fp32", "bf16")
# Canonical names of the matrices a product reads (the forms apply to these only).
_MATRICES = ("embed", "lm_head", ".q", ".k", ".v", ".o", ".gate", ".up", ".down", ".router")
_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "q",
    "attn_k.weight": "k",
    "attn_v.weight": "v",
    "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias",
    "attn_v.bias": "v_bias",
    "attn_output.weight": "o",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "ffn_norm.weight": "ffn_norm",
    "ffn_gate.weight": "gate",
    "ffn_up.weight": "up",
    "ffn_down.weight": "down",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "embed",
    "output_norm.weight": "norm",
    "output.weight": "lm_head",
    "rope_freqs.weight": "rope_freqs",
}


@dataclasses.dataclass
class LoadedModel:
    """What a loader returns: config, weights under canonical names, tokenizer source.

    Canonical weight names: embed, norm, lm_head (absent when tied), rope_freqs
    (optional), and layers.{i}.{attn_norm,q,k,v,q_bias,k_bias,v_bias,o,q_norm,k_norm,
    ffn_norm,gate,up,down}, each [out, in] in the rotate-half RoPE layout (fp32 tensors,
    or per `weight_form` bf16 tensors or QuantWeight for the matrices); a
    mixture-of-experts layer has router [experts, hidden] and experts.{j}.{gate,up,down}
    in place of gate, up, down (read from Hugging Face folders only).
    """

    config: ModelConfig
    weights: dict[str, Any]
    tokenizer_meta: dict[str, Any]
    model_id: str
    # How the matrices are held: "fp32", "bf16" or "native" (a GGUF's quantized blocks as
    # QuantWeight; an HF folder's bf16 tensors as bf16).
    weight_form: str = "fp32"


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: interleaved-pair rows back to rotate-half rows."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's `permute` (rotate-half rows to interleaved pairs); for tests."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_config(reader: Any) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    p = f"{arch}."
    num_heads = int(_field(reader, p + "attention.head_count"))
    hidden = int(_field(reader, p + "embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, p + "vocab_size") or (len(tokens.data) if tokens else None)
    if vocab is None:
        raise ValueError("gguf: neither a vocab_size nor the tokenizer's tokens")
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    rope_scaling = None
    if _field(reader, p + "rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": _field(reader, p + "rope.scaling.factor")}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(i for i in (eos, eot) if i is not None))
    return ModelConfig(
        arch="llama" if arch == "mistral" else arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, p + "feed_forward_length")),
        num_layers=int(_field(reader, p + "block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, p + "attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, p + "attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, p + "rope.freq_base", 10000.0)),
        max_position=int(_field(reader, p + "context_length", 4096)),
        tie_word_embeddings=not has_output,
        attention_bias=arch == "qwen2",
        rope_scaling=rope_scaling,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
    )


def metadata_reader(path: str) -> Any:
    """A GGUF file's reader for its metadata (memory-mapped: tensor data is never read).
    Parsing the metadata takes ~2 s for the default model's 49k-token vocabulary; the last
    reader is kept (for the same file, unchanged), so the tokenizer and the sampling
    defaults a router reads at start-up parse it once."""
    stat = os.stat(path)
    return _reader(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=1)
def _reader(path: str, mtime_ns: int, size: int) -> Any:
    import gguf

    return gguf.GGUFReader(path)


def read_tokenizer_meta(reader: Any) -> dict[str, Any]:
    """Every `tokenizer.*` field, decoded to Python values."""
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def load_gguf(path: str, weights: str = "fp32") -> LoadedModel:
    """Read a whole GGUF file; the matrices in the form `weights` (WEIGHT_FORMS)."""
    import gguf  # the reader is only needed by this loader
    import torch  # weights only: the metadata path above stays torch-free

    if weights not in WEIGHT_FORMS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMS)}, got {weights!r}")
    reader = gguf.GGUFReader(path)
    config = read_config(reader)
    # Only the llama arch's converter permutes Q/K; qwen2 uses NeoX RoPE as stored.
    permuted = _field(reader, "general.architecture") in ("llama", "mistral")
    tensors: dict[str, Any] = {}
    for i, tensor in enumerate(reader.tensors):
        kind = tensor.tensor_type.name
        if kind not in _SUPPORTED_TYPES:
            raise ValueError(f"{path}: tensor {tensor.name} has unsupported type {kind}")
        name = _canonical(tensor.name)
        if name is None:
            log.debug("gguf.tensor_skipped", tensor=tensor.name)
            continue
        matrix = name.endswith(_MATRICES)
        if weights == "native" and matrix and kind not in ("F32", "F16", "BF16"):
            data = tensor.data  # [rows, row bytes] of blocks, as stored
        else:
            data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            data = data.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if permuted and name.endswith((".q", ".q_bias")):
            data = unpermute_qk(data, config.num_heads)
        elif permuted and name.endswith((".k", ".k_bias")):
            data = unpermute_qk(data, config.num_kv_heads)
        tensors[name] = _held(data, kind, int(tensor.shape[0]), matrix, weights, torch)
        if i % 50 == 0:
            log.debug("gguf.progress", tensors=i, total=len(reader.tensors))
    name = _field(reader, "general.name") or path
    return LoadedModel(config, tensors, read_tokenizer_meta(reader), model_id=str(name),
                       weight_form=weights)  # fmt: skip


def _held(data: np.ndarray, kind: str, cols: int, matrix: bool, weights: str, torch) -> Any:
    """One tensor in the form it is kept in memory (copied out of the file's mmap)."""
    if data.dtype == np.uint8:  # quantized blocks, kept as they are
        from libs.common.engine.load.quantized import QuantWeight, block_storage

        held = block_storage(*data.shape)
        held.numpy()[...] = data
        return QuantWeight(kind, held, cols)
    out = torch.from_numpy(np.array(data, dtype=np.float32, copy=True))
    return out.to(torch.bfloat16) if weights == "bf16" and matrix else out


def _canonical(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None
