"""A tiny llama GGUF of quantized matrices, written by gguf-py's writer: the shapes and the
file the K-quant model test and the mixed-format test share (each picks the formats and
the blocks' bytes)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

HIDDEN, FFN, VOCAB = 256, 512, 320
# The matrices of a layer, in the file's order, [rows, cols] (4 heads, 2 KV heads of 64).
SHAPES = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (128, HIDDEN), "attn_v": (128, HIDDEN),
          "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
          "ffn_down": (HIDDEN, FFN)}  # fmt: skip

# (kind, rows, cols, seed) -> uint8 [rows, row bytes] of `kind` blocks
Blocks = Callable[[str, int, int, int], np.ndarray]


def write_tiny_llama_gguf(
    path, layers: list[dict[str, str]], *, embed_output: tuple[str, str], blocks: Blocks,
    seeds: tuple[int, int],
) -> None:  # fmt: skip
    """`layers`: each layer's format per matrix name of SHAPES; `embed_output`: the formats
    of token_embd and output; `seeds`: the norms' generator's, and the one before the first
    matrix's (each matrix takes the next)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(len(layers))
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    rng = np.random.default_rng(seeds[0])
    seed = seeds[1]

    def quantized(name: str, kind: str, shape: tuple[int, int]) -> None:
        nonlocal seed
        seed += 1
        data = blocks(kind, shape[0], shape[1], seed)
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])

    quantized("token_embd.weight", embed_output[0], (VOCAB, HIDDEN))
    quantized("output.weight", embed_output[1], (VOCAB, HIDDEN))
    writer.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
    for i, kinds in enumerate(layers):
        for norm in ("attn_norm", "ffn_norm"):
            values = rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32)
            writer.add_tensor(f"blk.{i}.{norm}.weight", values)
        for name, shape in SHAPES.items():
            quantized(f"blk.{i}.{name}.weight", kinds[name], shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
