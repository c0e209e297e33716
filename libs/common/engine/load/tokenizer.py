"""Tokenizer and chat template, from GGUF metadata or a Hugging Face folder.

GGUF "gpt2" vocabularies (SmolLM2, Llama 3, Qwen2) become a byte-level BPE
`tokenizers.Tokenizer` with the pre-tokenizer llama.cpp uses for the file's
`tokenizer.ggml.pre`; control and user-defined tokens are added as special
tokens so chat markers encode to one id. GGUF "llama" (SentencePiece)
vocabularies become a score-based Unigram model with byte fallback.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers as pre

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp token types that are control/special markers.
_CONTROL, _USER_DEFINED = 3, 4


def _pre_tokenizer(kind: str) -> Any:
    byte_level = pre.ByteLevel(add_prefix_space=False, use_regex=False)
    if kind in ("llama-bpe", "llama3", "dbrx", "smaug-bpe"):
        split = pre.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")
        return pre.Sequence([split, byte_level])
    if kind in ("qwen2", "deepseek-llm"):
        split = pre.Split(Regex(_QWEN2_SPLIT), behavior="isolated")
        return pre.Sequence([split, byte_level])
    steps: list[pre.PreTokenizer] = []
    if kind in ("smollm", "starcoder", "refact", "command-r", "codeshell"):
        steps.append(pre.Digits(individual_digits=True))
    steps.append(pre.ByteLevel(add_prefix_space=False, use_regex=True))
    return pre.Sequence(steps)


def tokenizer_from_gguf(meta: dict[str, Any]) -> Tokenizer:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    model = meta.get("tokenizer.ggml.model", "gpt2")
    if model == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
        tok.decoder = decoders.ByteLevel()
    elif model == "llama":
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        unk = meta.get("tokenizer.ggml.unknown_token_id", 0)
        scored = list(zip(tokens, (float(s) for s in scores), strict=True))
        tok = Tokenizer(models.Unigram(scored, unk_id=unk, byte_fallback=True))
        norm: list[normalizers.Normalizer] = [normalizers.Replace(" ", "▁")]
        if meta.get("tokenizer.ggml.add_space_prefix", True):
            norm.insert(0, normalizers.Prepend("▁"))
        tok.normalizer = normalizers.Sequence(norm)
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
            + (
                [decoders.Strip(" ", 1, 0)]
                if meta.get("tokenizer.ggml.add_space_prefix", True)
                else []
            )
        )
    else:
        raise ValueError(f"tokenizer.ggml.model {model!r} is not supported")
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, types, strict=True)
        if kind in (_CONTROL, _USER_DEFINED)
    ]
    tok.add_special_tokens(special)
    return tok


class TextTokenizer:
    """Encode, decode and render chat for one model.

    Contract: `encode(text, add_special=True)` prepends BOS when the model
    asks for it; `apply_chat_template(messages)` returns the prompt string
    (with the assistant turn opened by default); `decode` skips special tokens
    unless told otherwise. `eos_token_ids` ends generation unless ignore_eos.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        add_bos: bool,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos = add_bos and bos_token_id is not None
        self._template: Any = None

    @classmethod
    def from_gguf_meta(cls, meta: dict[str, Any], eos_token_ids: tuple[int, ...]) -> TextTokenizer:
        return cls(
            tokenizer_from_gguf(meta),
            meta.get("tokenizer.chat_template"),
            meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids,
            bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        )

    @classmethod
    def from_hf_folder(cls, folder: str, eos_token_ids: tuple[int, ...]) -> TextTokenizer:
        path = pathlib.Path(folder)
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg_path = path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)

        def token_id(name: str) -> int | None:
            value = cfg.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            return tok.token_to_id(value) if value else None

        eos = eos_token_ids or tuple(i for i in (token_id("eos_token"),) if i is not None)
        # Llama-style tokenizers add BOS in their post-processor already.
        return cls(tok, template, token_id("bos_token"), eos, add_bos=False)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=add_special).ids
        bos = self.bos_token_id  # set whenever add_bos is
        if add_special and self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        if not self.chat_template:
            raise ValueError("chat: this model has no chat template")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(self.chat_template)

        def name(i: int | None) -> str | None:
            return self.tokenizer.id_to_token(i) if i is not None else ""

        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=name(self.bos_token_id),
            eos_token=name(self.eos_token_ids[0] if self.eos_token_ids else None),
            **extra,
        )


def _raise(message: str) -> None:
    raise ValueError(f"chat template: {message}")
