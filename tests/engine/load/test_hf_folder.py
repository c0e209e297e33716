"""A Hugging Face folder (config.json, safetensors, tokenizer.json) loads and matches the GGUF."""

from __future__ import annotations

import pytest

from bench.peer_model import write as write_hf_folder
from libs.common.engine.config import EngineConfig
from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.load.source import load_model
from libs.common.engine.model.model import LlamaModel
from libs.common.engine.step_loop import EngineCore
from tests.engine.conftest import run_to_end

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, reference_model):
    """The default model as a plain HF folder (transformers won't save a GGUF-loaded model
    as it is, so bench.peer_model copies its tensors into a LlamaForCausalLM)."""
    folder = tmp_path_factory.mktemp("hf-smollm2")
    write_hf_folder(folder, reference_model)
    return folder


def test_hf_folder_generates_the_same_greedy_tokens_as_the_gguf(hf_folder, make_core):
    loaded, tokenizer = load_model(str(hf_folder))
    assert loaded.config.num_layers == 30 and "lm_head" not in loaded.weights
    hf_core = EngineCore(EngineConfig(kv_cache_mb=32), LlamaModel(loaded), tokenizer)
    gguf_core = make_core()
    prompt = tokenizer.encode("The three primary colors are")
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for core in (hf_core, gguf_core):
        core.add("x", prompt, params)
    assert run_to_end(hf_core)["x"] == run_to_end(gguf_core)["x"]
    assert tokenizer.decode(prompt) == "The three primary colors are"
