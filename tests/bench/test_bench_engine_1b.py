"""bench.engine's synthetic ~1B model: the GGUF writer (bench/synthetic_model.py) on a small
config of the same kind, read by our loader and run by our engine, and the harness's peer
and verdict paths (bench/engine_1b.py)."""

from __future__ import annotations

import dataclasses
import pathlib

import gguf
import numpy as np
import pytest
import torch

from bench import engine_1b, peer_llama_cpp, synthetic_model
from libs.common.engine.config import EngineConfig
from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.load.quantized import QuantWeight
from libs.common.engine.load.source import load_model
from libs.common.engine.model.model import LlamaModel
from libs.common.engine.step_loop import EngineCore

# The 1B model's kind at a size a test writes and loads in seconds (the vocabulary stays
# the default model's: the tokenizer is copied).
SMALL = synthetic_model.SyntheticLlama(hidden=256, layers=3, ffn=768, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def small_file(tmp_path_factory) -> pathlib.Path:
    return synthetic_model.ensure(SMALL, tmp_path_factory.mktemp("synthetic"))


@pytest.fixture(scope="module")
def small_model(small_file):
    torch.set_num_threads(1)
    return load_model(str(small_file), weights="native")


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0"])
def test_random_blocks_decode_to_weights_centred_on_zero_with_the_asked_spread(kind):
    # gguf-py's own decoder reads them: the blocks are well formed, scales of a real size.
    rng = np.random.default_rng(3)
    blocks = synthetic_model.matrix(rng, kind, 64, 1024, sigma=0.02)
    values = gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, kind))
    assert values.shape == (64, 1024) and np.isfinite(values).all()
    assert abs(float(values.mean())) < 0.002
    assert 0.017 < float(values.std()) < 0.023


def test_our_loader_reads_the_shapes_formats_and_tokenizer_written(small_model):
    loaded, tokenizer = small_model
    cfg = loaded.config
    assert (cfg.hidden_size, cfg.num_layers, cfg.intermediate_size) == (256, 3, 768)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 64)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152
    assert cfg.num_params == SMALL.num_params(49152)
    w = loaded.weights
    assert isinstance(w["embed"], QuantWeight) and w["embed"].kind == "Q6_K"
    assert w["embed"].shape == (49152, 256)
    shapes = {"q": (256, 256), "k": (128, 256), "v": (128, 256), "o": (256, 256),
              "gate": (768, 256), "up": (768, 256), "down": (256, 768)}  # fmt: skip
    for i in range(3):
        for name, shape in shapes.items():
            matrix = w[f"layers.{i}.{name}"]
            assert isinstance(matrix, QuantWeight) and matrix.kind == "Q4_K"
            assert matrix.shape == shape
    assert tokenizer.decode(tokenizer.encode("Hello world")) == "Hello world"


def test_its_logits_are_finite_and_the_argmax_varies_with_the_prompt(small_model):
    loaded, tokenizer = small_model
    core = EngineCore(EngineConfig(kv_cache_mb=8, num_threads=1), LlamaModel(loaded), tokenizer)
    argmaxes = set()
    for i in range(6):
        ids = [100 + 977 * i + 31 * j for j in range(12)]
        core.add(str(i), ids, SamplingParams(max_tokens=1, temperature=0))
        sched = core.scheduler.schedule()
        logits = core.model.logits(core.runner.forward(sched.scheduled))[0]
        core.scheduler.postprocess(sched, {str(i): int(logits.argmax())})
        assert torch.isfinite(logits).all() and float(logits.std()) > 0.05
        argmaxes.add(int(logits.argmax()))
    assert len(argmaxes) >= 3


def test_the_file_is_written_once_and_other_parameters_are_another_file(small_file):
    written = small_file.stat().st_mtime_ns
    again = synthetic_model.ensure(SMALL, small_file.parent)
    assert again == small_file and again.stat().st_mtime_ns == written
    other = dataclasses.replace(SMALL, seed=1)
    assert other.key(pathlib.Path(__file__)) != SMALL.key(pathlib.Path(__file__))


def test_the_default_spec_is_a_1b_llama():
    spec = synthetic_model.SyntheticLlama()
    assert 1.0e9 < spec.num_params(49152) < 1.1e9


def test_a_bad_shape_is_refused_by_name():
    with pytest.raises(ValueError, match="multiples of 256"):
        synthetic_model.SyntheticLlama(hidden=200)
    with pytest.raises(ValueError, match="embed_type"):
        synthetic_model.SyntheticLlama(embed_type="Q4_0")


def test_an_unbuilt_peer_is_reported_absent_with_the_make_target(tmp_path):
    args = type("Args", (), {"threads": 2, "new_tokens": 128})()
    section = engine_1b.peer_section(tmp_path, tmp_path / "model.gguf", args)
    assert section == {"absent": f"not built: no llama-bench in {tmp_path / 'bin'} "
                                 f"(make bench-peers)"}  # fmt: skip
    assert engine_1b.peer_section(None, tmp_path / "model.gguf", args)["absent"].startswith(
        "disabled"
    )


def test_without_the_peer_only_the_bandwidth_goal_has_a_verdict():
    out = engine_1b.verdicts(30.0, 50.0, {"absent": "not built"}, "tg128")
    assert out["ratios"] == {"fraction_of_read_bandwidth_bound": 0.6}
    assert out["verdicts"] == {"single_stream_50%_read_bandwidth_bound": True}


def test_with_the_peer_the_ratio_is_ours_over_tg():
    peer = {"llama_bench": {"tg128": {"tok_s": 40.0}}}
    out = engine_1b.verdicts(30.0, 80.0, peer, "tg128")
    assert out["ratios"]["single_stream_vs_tg128"] == 0.75
    assert out["ratios"]["llama_cpp_fraction_of_read_bandwidth_bound"] == 0.5
    assert out["verdicts"] == {"single_stream_50%_read_bandwidth_bound": False,
                               "single_stream_vs_tg128_1.0x": False}  # fmt: skip


def test_the_prefill_ratio_is_ours_over_pp512_and_has_no_verdict():
    peer = {"llama_bench": {"tg128": {"tok_s": 40.0}, "pp512": {"tok_s": 200.0}}}
    out = engine_1b.verdicts(30.0, 80.0, peer, "tg128", prefill=300.0)
    assert out["ratios"]["prefill_vs_pp512"] == 1.5
    assert "prefill_vs_pp512" not in str(out["verdicts"])
    assert "prefill_vs_pp512" not in engine_1b.verdicts(30.0, 80.0, peer, "tg128")["ratios"]


def test_the_built_llama_bench_reads_the_synthetic_file(small_file):
    folder = peer_llama_cpp.DEFAULT_DIR
    why = peer_llama_cpp.missing(folder, ("llama-bench",))
    if why:
        pytest.skip(f"llama.cpp peer {why}")
    out = peer_llama_cpp.run_llama_bench(folder, small_file, 1, [0], 4, repetitions=1,
                                         timeout=120)  # fmt: skip
    assert set(out) == {"tg4"} and out["tg4"]["tok_s"] > 0
