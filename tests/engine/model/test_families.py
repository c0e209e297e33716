"""Each supported model family against transformers on a tiny random checkpoint.

Every test builds its checkpoint here: a transformers config (64 hidden, 2 layers,
4 heads, 2 KV heads, 256 tokens), random weights from a fixed seed with every bias
and norm weight randomized too (transformers initializes them to 0 and 1, which would
hide a missing bias or norm), saved as safetensors with a word-level tokenizer.json.
Our loader reads the folder; both models run in fp32.
"""

from __future__ import annotations

import pytest
import torch

from libs.common.engine.config import EngineConfig
from libs.common.engine.core.sampling_params import SamplingParams
from libs.common.engine.load.hf import load_hf_folder
from libs.common.engine.load.source import load_model
from libs.common.engine.model.model import LlamaModel, RoutedExperts
from libs.common.engine.step_loop import EngineCore
from tests.engine.conftest import run_to_end

transformers = pytest.importorskip("transformers")

VOCAB = 256
NEW_TOKENS = 16
# Llama 3.1's RoPE schedule over a 64-token original context: prompts run past it.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
               "rope_theta": 10000.0}  # fmt: skip
SHAPE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 512, "bos_token_id": None, "eos_token_id": None,
         "tie_word_embeddings": False, "initializer_range": 0.1}  # fmt: skip
FAMILIES = {
    "llama3": lambda: transformers.LlamaConfig(**SHAPE, rope_parameters=LLAMA3_ROPE),
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE),
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, head_dim=16),
    # head_dim 32 with 4 heads: q is 128 wide over a 64-wide residual (as in Mistral Nemo).
    "mistral": lambda: transformers.MistralConfig(**SHAPE, head_dim=32),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SHAPE,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    "mixtral": lambda: transformers.MixtralConfig(
        **SHAPE, num_local_experts=4, num_experts_per_tok=2
    ),
}
# Prompts: one past the llama3 original context (96 tokens), one short.
PROMPTS = [
    torch.randint(0, VOCAB, (96,), generator=torch.Generator().manual_seed(1)).tolist(),
    torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(2)).tolist(),
]
# Logit gap under which a flip between the top two tokens is a numerical tie.
TIE = 1e-4


def write_tokenizer(folder) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, our model, tokenizer, transformers model) for one family."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = FAMILIES[request.param]()
    reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(str(folder), safe_serialization=True)
    write_tokenizer(folder)
    loaded, tokenizer = load_model(str(folder))
    return request.param, LlamaModel(loaded), tokenizer, reference.eval()


def make_core(model, tokenizer) -> EngineCore:
    return EngineCore(EngineConfig(kv_cache_mb=8, num_threads=1), model, tokenizer)


def test_last_position_logits_within_1e4_relative_of_transformers(family):
    name, model, tokenizer, reference = family
    core = make_core(model, tokenizer)
    for i, ids in enumerate(PROMPTS):
        core.add(str(i), ids, SamplingParams(max_tokens=1, temperature=0))
        sched = core.scheduler.schedule()
        ours = core.model.logits(core.runner.forward(sched.scheduled))[0]
        core.scheduler.postprocess(sched, {str(i): int(ours.argmax())})
        with torch.no_grad():
            ref = reference(torch.tensor([ids])).logits[0, -1].float()
        rel = float((ours - ref).abs().max() / ref.abs().max())
        assert rel < 1e-4, f"{name} prompt {i}: relative error {rel:.2e}"


def test_greedy_tokens_equal_transformers_generate(family):
    """Both prompts batched together in our engine; each generated alone by transformers."""
    name, model, tokenizer, reference = family
    core = make_core(model, tokenizer)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for i, ids in enumerate(PROMPTS):
        core.add(str(i), ids, params)
    ours = run_to_end(core)
    for i, ids in enumerate(PROMPTS):
        prompt = torch.tensor([ids])
        with torch.no_grad():
            out = reference.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            logits = reference(out[:, :-1]).logits[0, len(ids) - 1 :]
        top2 = logits.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min() > TIE, f"{name}: a numerical tie, pick another seed"
        assert ours[str(i)] == out[0, len(ids) :].tolist(), f"{name} prompt {i}"


def test_routed_experts_exactly_in_the_layers_the_checkpoint_routes(family):
    """Qwen3-MoE's layer 1 is dense (mlp_only_layers); every Mixtral layer routes."""
    name, model, _, _ = family
    routed = [isinstance(layer.mlp, RoutedExperts) for layer in model.layers]
    assert routed == {"qwen3_moe": [True, False], "mixtral": [True, True]}.get(name, [False] * 2)
    if routed[0]:
        experts = model.layers[0].mlp.experts
        assert len(experts) == model.config.num_experts > model.config.experts_per_token


def test_unsupported_architecture_raises_value_error_naming_it(tmp_path):
    config = transformers.Qwen2MoeConfig(**SHAPE)
    config.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="qwen2_moe"):
        load_hf_folder(str(tmp_path))
