"""Prompts cached by content hash (services/router/requests/prompt_cache.py): the same ids
and text as the work itself, within each cache's bound, on the default model's real
tokenizer and chat template."""

from __future__ import annotations

from array import array

import pytest

from libs.common.engine.load.source import default_model_path, load_tokenizer
from services.router.formats.openai.chat_template import TemplateArgs
from services.router.requests import prompt_cache
from services.router.requests.prompt_cache import Bounded, text_key
from services.router.requests.prompts import PromptTooLong, encode, render_chat


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_path())[0]


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(prompt_cache, "IDS", Bounded(4 << 20))
    monkeypatch.setattr(prompt_cache, "TEXTS", Bounded(32 << 20))


def counting(monkeypatch, obj, name):
    calls = []
    real = getattr(obj, name)
    monkeypatch.setattr(obj, name, lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls


def test_a_long_text_is_tokenized_once_and_gives_the_same_ids(tok, fresh, monkeypatch):
    text = "The lighthouse keeper counts the ships. " * 100
    first = encode(tok, text)
    assert len(prompt_cache.IDS) == 1
    first.append(-1)  # a caller's list is its own: the cache is not changed through it
    calls = counting(monkeypatch, tok.tokenizer, "encode_batch_fast")
    again = encode(tok, text)
    assert calls == [] and again == first[:-1] == tok.encode(text)


def test_the_limit_holds_on_a_cached_text(tok, fresh):
    text = "word " * 600
    n = len(encode(tok, text))
    with pytest.raises(PromptTooLong) as e:
        encode(tok, text, limit=n // 2)  # from the cache now
    assert e.value.num_tokens == n


def test_a_chat_is_rendered_once_per_messages_and_options(tok, fresh, monkeypatch):
    messages = [{"role": "user", "content": "Tell me about lighthouses. " * 60}]
    first = render_chat(tok, messages)
    calls = counting(monkeypatch, tok, "apply_chat_template")
    assert render_chat(tok, [dict(m) for m in messages]) == first and calls == []
    other = render_chat(tok, messages, template=TemplateArgs(add_generation_prompt=False))
    assert len(calls) == 1 and other != first  # other options: rendered, not the cached one


def test_short_inputs_are_not_kept_and_the_bound_evicts_the_oldest():
    cache: Bounded[array] = Bounded(1000)
    assert text_key(object(), "short") is None
    owner = object()
    keys = [text_key(owner, f"{i} " + "x" * 2000) for i in range(5)]
    for k in keys:
        assert k is not None
        cache.put(k, array("I", range(240)))
    assert len(cache) == 4  # 5 x 240 ids > 1000: the first went
    assert keys[0] is not None and cache.get(keys[0]) is None
    assert keys[4] is not None and list(cache.get(keys[4]) or []) == list(range(240))
    big = text_key(owner, "y" * 5000)
    assert big is not None
    cache.put(big, array("I", range(300)))  # over a quarter of the bound: not kept
    assert cache.get(big) is None
