"""Prompt ids cached by the text's hash (services/router/requests/token_cache.py): the same
ids as tokenizing, within the cache's bound, on the default model's real tokenizer."""

from __future__ import annotations

import pytest

from libs.common.engine.load.source import default_model_path, load_tokenizer
from services.router.requests import token_cache
from services.router.requests.prompts import PromptTooLong, encode
from services.router.requests.token_cache import IdsCache


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_path())[0]


def test_a_long_text_is_tokenized_once_and_gives_the_same_ids(tok, monkeypatch):
    cache = IdsCache()
    monkeypatch.setattr(token_cache, "IDS", cache)
    text = "The lighthouse keeper counts the ships. " * 100
    first = encode(tok, text)
    assert len(cache) == 1
    first.append(-1)  # a caller's list is its own: the cache is not changed through it
    calls = []
    real = tok.tokenizer.encode_batch_fast
    monkeypatch.setattr(
        tok.tokenizer, "encode_batch_fast", lambda *a, **k: calls.append(a) or real(*a, **k)
    )
    again = encode(tok, text)
    assert calls == [] and again == first[:-1] == tok.encode(text)


def test_the_limit_holds_on_a_cached_text(tok, monkeypatch):
    monkeypatch.setattr(token_cache, "IDS", IdsCache())
    text = "word " * 600
    n = len(encode(tok, text))
    with pytest.raises(PromptTooLong) as e:
        encode(tok, text, limit=n // 2)  # from the cache now
    assert e.value.num_tokens == n


def test_short_texts_are_not_kept_and_the_bound_evicts_the_oldest():
    cache = IdsCache(max_ids=1000)
    assert IdsCache.key(object(), "short") is None
    owner = object()
    keys = [IdsCache.key(owner, f"{i} " + "x" * 2000) for i in range(5)]
    assert all(k is not None for k in keys)
    for k in keys:
        assert k is not None
        cache.put(k, list(range(240)), 240)
    assert len(cache) == 4  # 5 x 240 ids > 1000: the first went
    assert keys[0] is not None and cache.get(keys[0]) is None
    assert keys[4] is not None and cache.get(keys[4]) == (list(range(240)), 240)
    big = IdsCache.key(owner, "y" * 5000)
    assert big is not None
    cache.put(big, list(range(300)), 300)  # over a quarter of the bound: not kept
    assert cache.get(big) is None
