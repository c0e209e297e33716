"""A tiny Qwen3 reasoning model, made here: a byte-level tokenizer with Qwen3's chat and
thinking tokens, a chat template that thinks like Qwen3's (`enable_thinking`), and a
random transformers Qwen3 checkpoint whose greedy output is known.

Random weights would never write `</think>`, so the checkpoint is set by hand: every layer
adds nothing to the residual stream (its output projections are zero), so the last hidden
state is the last token's embedding; the embeddings of the tokens of ANSWER are orthogonal,
and the head maps each to the token that follows it. After a prompt that ends with "\\n"
(the assistant turn's opening) the model writes ANSWER, at any temperature.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

from scripts.cluster import LocalCluster
from tests.router.conftest import router_env, router_port
from tests.router.e2e_cluster import WORKER_ARGS, wait_healthy

MODEL = "tiny-qwen3"  # the name the router serves it under

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added tokens that are not special: decoded into the text, as in Qwen3's tokenizer.
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
# What the model writes after "\n": thinks "ab", answers "Hi", ends its turn.
ANSWER = ["<think>", "a", "b", "</think>", "H", "i", "<|im_end|>"]
REASONING, CONTENT = "ab", "Hi"

# A ChatML template written for this test, thinking as Qwen3's does: with enable_thinking
# false the prompt carries an empty thinking part, closed.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def tokenizer(think_tokens: bool = True, tool_tokens: bool = True):
    """A byte-level BPE tokenizer without merges: one token per byte, then the added;
    without `think_tokens` ("<think>", "</think>") or `tool_tokens` ("<tool_call>",
    "</tool_call>") those are plain text (bytes)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    added = [t for t in ADDED if (think_tokens if "think" in t else tool_tokens)]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return tok


def write_model(folder: Path) -> Path:
    """The checkpoint, tokenizer and chat template in `folder` (an HF folder)."""
    import torch
    import transformers

    tok = tokenizer()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    eos = tok.token_to_id("<|im_end|>")
    hidden = 64
    qwen = transformers.Qwen3Config(
        vocab_size=tok.get_vocab_size(), hidden_size=hidden, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=eos,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(qwen, dtype=torch.float32)
    chain = [tok.encode(t).ids[0] for t in ["\n", *ANSWER]]  # one token each
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        embed = model.model.embed_tokens.weight
        embed.mul_(0.01)
        head = model.lm_head.weight
        head.zero_()
        for k, (token, after) in enumerate(itertools.pairwise(chain)):
            embed[token].zero_()
            embed[token, k] = hidden**0.5  # RMS 1: the final norm leaves it as it is
            head[after, k] = 10.0
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def serve(nats_url: str, tmp_path_factory, service_id: str) -> Iterator[str]:
    """The tiny model (as MODEL) on a real cluster, one prefill and one decode worker
    and a router: yields the router's base URL, stops the processes after (a generator for
    a module-scoped fixture)."""
    folder = write_model(tmp_path_factory.mktemp("tiny-qwen3"))
    logs = tmp_path_factory.mktemp(f"{service_id}-logs")
    cluster = LocalCluster(nats_url, env=router_env(), capture=logs)
    try:
        for role, sid in (("prefill", "p1"), ("decode", "d1")):
            cluster.start_one(role, "--service-id", sid, *WORKER_ARGS, "--model", str(folder),
                              label=sid)  # fmt: skip
        cluster.start_one("router", "--service-id", service_id, "--port", "0",
                          "--model", str(folder), "--served-model-name", MODEL)  # fmt: skip
        port = asyncio.run(router_port(nats_url, service_id, 240))
        base = f"http://127.0.0.1:{port}"
        asyncio.run(wait_healthy(base, {"prefill": 1, "decode": 1}, 240, cluster.procs))
        yield base
    finally:
        cluster.stop()
