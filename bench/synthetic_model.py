"""A synthetic Llama in Q4_K: the model size people serve, with random weights.

    python -m bench.synthetic_model [--layers 16 ...]   # prints the cached file's path

bench.engine's `--model synthetic-1b` runs our engine and llama-bench on the same file: on
the 135M default model per-step Python overhead hides the kernels, on ~1B parameters the
weights' bytes dominate a decode step. `SyntheticLlama()`'s shapes are Llama 3.2 1B's
(hidden 2048, 16 layers, FFN 8192, 32 heads, 8 KV heads, tied embedding: 1.07B weights with
the default model's 49,152-token vocabulary). As in a Q4_K_M file, the layers' matrices are
Q4_K and the tied embedding (the output too) Q6_K (or Q8_0: `embed_type`).

The blocks are random but well formed: 4-bit values uniform, the sub-block scales random
6-bit numbers with each sub-block's min set so its weights centre on zero, and the fp16
super-block scales sized for a weight standard deviation of `sigma` (0.02, a trained
Llama's order), so activations stay finite over the layers and the argmax varies with the
input. The tokenizer (every `tokenizer.*` field) is the default model's, so both engines
load the file and text prompts work. Written once with gguf-py's writer (tensor by tensor:
memory stays at one matrix), cached under ~/.cache/tandem/bench/ (or $XDG_CACHE_HOME) by
a hash of the parameters, the writer's FORMAT and the tokenizer's source file.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import pathlib
import sys
from collections.abc import Iterator

import numpy as np

FORMAT = 1  # bump when the bytes written for the same parameters change
QK_K = 256
BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210, "Q8_0": 34}
BLOCK_VALUES = {"Q4_K": QK_K, "Q6_K": QK_K, "Q8_0": 32}
# GGUF's general.file_type: MOSTLY_Q4_K_M
FILE_TYPE_Q4_K_M = 15


@dataclasses.dataclass(frozen=True)
class SyntheticLlama:
    """The model's shapes and formats; the defaults are the ~1B model of bench.engine."""

    hidden: int = 2048
    layers: int = 16
    ffn: int = 8192
    heads: int = 32
    kv_heads: int = 8
    embed_type: str = "Q6_K"  # tied embedding and output
    sigma: float = 0.02
    context: int = 4096
    rope_theta: float = 500000.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.embed_type not in ("Q6_K", "Q8_0"):
            raise ValueError(f"embed_type: Q6_K or Q8_0, got {self.embed_type!r}")
        if self.hidden % QK_K or self.ffn % QK_K:
            raise ValueError(f"hidden and ffn must be multiples of {QK_K} (Q4_K rows)")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError("heads must divide hidden, and kv_heads heads")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def matrices(self) -> Iterator[tuple[str, int, int]]:
        """(GGUF name, rows, cols) of every layer matrix, in the file's order."""
        kv = self.kv_heads * self.head_dim
        for i in range(self.layers):
            yield f"blk.{i}.attn_q.weight", self.hidden, self.hidden
            yield f"blk.{i}.attn_k.weight", kv, self.hidden
            yield f"blk.{i}.attn_v.weight", kv, self.hidden
            yield f"blk.{i}.attn_output.weight", self.hidden, self.hidden
            yield f"blk.{i}.ffn_gate.weight", self.ffn, self.hidden
            yield f"blk.{i}.ffn_up.weight", self.ffn, self.hidden
            yield f"blk.{i}.ffn_down.weight", self.hidden, self.ffn

    def num_params(self, vocab: int) -> int:
        return vocab * self.hidden + sum(r * c for _, r, c in self.matrices())

    def key(self, tokenizer_source: pathlib.Path) -> str:
        stat = tokenizer_source.stat()
        text = f"{FORMAT} {dataclasses.astuple(self)} {tokenizer_source.name} {stat.st_size}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def q4_k_blocks(rng: np.random.Generator, n: int, sigma: float) -> np.ndarray:
    """n Q4_K blocks [n, 144]: d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 of
    4-bit values. A weight is d*sc*q - dmin*m; with dmin = 7.5 d and m ~ sc each sub-block's
    mean is ~0 and its standard deviation d*sc*4.6 (q uniform on 0..15)."""
    out = rng.integers(0, 256, size=(n, 144), dtype=np.uint8)  # the 4-bit values stay
    sc = rng.integers(32, 64, size=(n, 8), dtype=np.int16)
    m = np.clip(sc + rng.integers(-2, 3, size=(n, 8), dtype=np.int16), 0, 63)
    d = sigma / (sc.mean(axis=1) * 4.61) * rng.uniform(0.8, 1.2, size=n)
    out[:, 0:2] = _fp16_bytes(d)
    out[:, 2:4] = _fp16_bytes(d * 7.5)
    low, high = sc[:, :4], sc[:, 4:]
    mlow, mhigh = m[:, :4], m[:, 4:]
    # llama.cpp's packing: bytes 0-3 sc[0..3] | sc[4..7] bits 4-5 on top; 4-7 the same for
    # the mins; 8-11 the low nibbles of sc[4..7] and m[4..7].
    out[:, 4:8] = (low | ((high >> 4) << 6)).astype(np.uint8)
    out[:, 8:12] = (mlow | ((mhigh >> 4) << 6)).astype(np.uint8)
    out[:, 12:16] = ((high & 0xF) | ((mhigh & 0xF) << 4)).astype(np.uint8)
    return out


def q6_k_blocks(rng: np.random.Generator, n: int, sigma: float) -> np.ndarray:
    """n Q6_K blocks [n, 210]: 128 bytes of low nibbles, 64 of high bits, 16 int8 scales,
    d (fp16). A weight is d*sc*(q-32), q uniform on 0..63 (standard deviation 18.5)."""
    out = rng.integers(0, 256, size=(n, 210), dtype=np.uint8)
    sc = rng.integers(16, 64, size=(n, 16), dtype=np.int16) * rng.choice([-1, 1], size=(n, 16))
    out[:, 192:208] = sc.astype(np.int8).view(np.uint8)
    d = sigma / (np.abs(sc).mean(axis=1) * 18.5) * rng.uniform(0.8, 1.2, size=n)
    out[:, 208:210] = _fp16_bytes(d)
    return out


def q8_0_blocks(rng: np.random.Generator, n: int, sigma: float) -> np.ndarray:
    """n Q8_0 blocks [n, 34]: d (fp16) and 32 int8 values uniform on -127..127 (sd 73.3)."""
    out = rng.integers(0, 256, size=(n, 34), dtype=np.uint8)
    q = rng.integers(-127, 128, size=(n, 32), dtype=np.int16)
    out[:, 2:] = q.astype(np.int8).view(np.uint8)
    out[:, 0:2] = _fp16_bytes(sigma / 73.3 * rng.uniform(0.8, 1.2, size=n))
    return out


BLOCK_WRITERS = {"Q4_K": q4_k_blocks, "Q6_K": q6_k_blocks, "Q8_0": q8_0_blocks}


def matrix(rng: np.random.Generator, kind: str, rows: int, cols: int, sigma: float) -> np.ndarray:
    """A [rows, row bytes] uint8 matrix of `kind` blocks, as a GGUF stores it."""
    per_row = cols // BLOCK_VALUES[kind]
    blocks = BLOCK_WRITERS[kind](rng, rows * per_row, sigma)
    return blocks.reshape(rows, per_row * BLOCK_BYTES[kind])


def _tokenizer_fields(source: pathlib.Path) -> list[tuple[str, object, list]]:
    import gguf

    reader = gguf.GGUFReader(source)
    out = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            out.append((key, field.contents(), field.types))
    return out


def write(spec: SyntheticLlama, path: pathlib.Path, tokenizer_source: pathlib.Path) -> None:
    """Write the model to `path` (one matrix in memory at a time)."""
    import gguf

    fields = _tokenizer_fields(tokenizer_source)
    tokens = next(value for key, value, _ in fields if key == "tokenizer.ggml.tokens")
    vocab = len(tokens)
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_name(f"synthetic llama {spec.num_params(vocab) / 1e9:.2f}B Q4_K")
    w.add_block_count(spec.layers)
    w.add_context_length(spec.context)
    w.add_embedding_length(spec.hidden)
    w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.heads)
    w.add_head_count_kv(spec.kv_heads)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_vocab_size(vocab)
    w.add_file_type(FILE_TYPE_Q4_K_M)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value, types in fields:
        sub = types[1] if types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, types[0], sub)
    plan = _plan(spec, vocab)
    for name, kind, rows, cols in plan:
        nbytes = rows * cols // BLOCK_VALUES.get(kind, 1) * BLOCK_BYTES.get(kind, 4)
        raw = getattr(gguf.GGMLQuantizationType, kind)
        if kind == "F32":
            w.add_tensor_info(name, (cols,), np.dtype(np.float32), nbytes, raw)
        else:
            w.add_tensor_info(name, (rows, nbytes // rows), np.dtype(np.uint8), nbytes, raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(spec.seed)
    for _, kind, rows, cols in plan:
        if kind == "F32":  # a norm's weight: ~1, as trained ones are
            w.write_tensor_data(rng.uniform(0.9, 1.1, size=cols).astype(np.float32))
        else:
            w.write_tensor_data(matrix(rng, kind, rows, cols, spec.sigma))
    w.close()


def _plan(spec: SyntheticLlama, vocab: int) -> list[tuple[str, str, int, int]]:
    """(name, type, rows, cols) of every tensor, in the order written."""
    plan = [("token_embd.weight", spec.embed_type, vocab, spec.hidden)]
    names = list(spec.matrices())
    for i in range(spec.layers):
        plan.append((f"blk.{i}.attn_norm.weight", "F32", 1, spec.hidden))
        plan.extend((n, "Q4_K", r, c) for n, r, c in names[i * 7 : i * 7 + 7])
        plan.append((f"blk.{i}.ffn_norm.weight", "F32", 1, spec.hidden))
    plan.append(("output_norm.weight", "F32", 1, spec.hidden))
    return plan


def cache_dir() -> pathlib.Path:
    base = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache"))
    return base / "tandem" / "bench"


def ensure(spec: SyntheticLlama, folder: pathlib.Path | None = None) -> pathlib.Path:
    """The model's GGUF under `folder` (cache_dir() by default), written when not there."""
    from libs.common.engine.load.source import default_model_path

    source = pathlib.Path(default_model_path())
    folder = folder or cache_dir()
    path = folder / f"synthetic-llama-{spec.layers}l-{spec.hidden}h-{spec.key(source)}.gguf"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.part")
    try:
        write(spec, partial, source)
        partial.rename(path)  # concurrent writers: the same bytes, the last rename wins
    finally:
        partial.unlink(missing_ok=True)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.synthetic_model",
                                     description=__doc__.split("\n")[0])  # fmt: skip
    names = [f.name for f in dataclasses.fields(SyntheticLlama)]
    defaults = dataclasses.asdict(SyntheticLlama())
    for name in names:
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(defaults[name]),
                            default=defaults[name])  # fmt: skip
    args = parser.parse_args(argv)
    try:
        spec = SyntheticLlama(**{name: getattr(args, name) for name in names})
    except ValueError as e:
        parser.error(str(e))
    print(ensure(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
