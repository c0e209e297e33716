"""Chained page keys: deterministic everywhere, full pages only, salted by model/dtype/size."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import xxhash

from libs.common.engine.core.kv_hash import PageHasher

ROOT = Path(__file__).resolve().parents[3]  # the repository root, for `import libs`
TOKENS = [(i * 7919) % 50_000 for i in range(100)]


def hasher(model: str = "smollm2-135m", dtype: str = "float32", page_size: int = 16) -> PageHasher:
    return PageHasher(model, dtype, page_size)


def test_only_full_pages_get_keys():
    assert len(hasher().keys(TOKENS)) == 100 // 16
    assert hasher().keys(TOKENS[:15]) == []


def test_keys_are_32_char_lowercase_hex_strings():
    for key in hasher().keys(TOKENS):
        assert isinstance(key, str) and len(key) == 32
        assert key == key.lower() and int(key, 16) >= 0


def test_keys_are_identical_in_another_process():
    code = (
        "from libs.common.engine.core.kv_hash import PageHasher;"
        f"print(','.join(PageHasher('smollm2-135m', 'float32', 16).keys({TOKENS!r})))"
    )
    # A different hash seed proves no Python hash() leaks into the keys.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=ROOT
    )
    assert done.stdout.strip().split(",") == hasher().keys(TOKENS)


def test_keys_match_the_pinned_recipe():
    # Pinned so that a change of the recipe (which orphans every cached page in
    # the cluster) is deliberate: bump KEY_SCHEME and this value together.
    page = list(range(16))
    salt = b"tandem-kv-v1\0smollm2-135m\0float32\x0016\0"
    by_hand = xxhash.xxh3_128_hexdigest(bytes(16) + salt + struct.pack("<16i", *page))
    assert hasher().keys(page) == [by_hand] == ["b90ccd06d740a30e22aaab6128560d25"]


@pytest.mark.parametrize(
    "other",
    [hasher(model="other-model"), hasher(dtype="bfloat16"), hasher(page_size=8)],
    ids=["model_id", "kv_dtype", "page_size"],
)
def test_model_id_kv_dtype_and_page_size_change_every_key(other: PageHasher):
    mine = hasher().keys(TOKENS[:64])
    theirs = other.keys(TOKENS[:64])
    assert not set(mine) & set(theirs)


def test_a_key_depends_on_its_whole_prefix_and_nothing_after():
    base = hasher().keys(TOKENS)
    changed_page2 = [*TOKENS[:40], TOKENS[40] + 1, *TOKENS[41:]]
    keys = hasher().keys(changed_page2)
    assert keys[:2] == base[:2]
    assert all(a != b for a, b in zip(keys[2:], base[2:], strict=True))


def test_extend_gives_the_same_keys_as_hashing_at_once():
    h = hasher()
    known: list[str] = []
    for end in range(0, len(TOKENS) + 1, 5):
        known += h.extend(TOKENS[:end], known)
    assert known == h.keys(TOKENS)


def test_keys_chain_after_a_parent():
    h = hasher()
    whole = h.keys(TOKENS[:64])
    assert h.keys(TOKENS[32:64], parent=whole[1]) == whole[2:]


def test_token_ids_beyond_int32_raise_value_error():
    with pytest.raises(ValueError, match="int32"):
        hasher().keys([2**31] * 16)


def test_a_bad_parent_key_raises_value_error():
    with pytest.raises(ValueError, match="page key"):
        hasher().keys(TOKENS, parent="not-a-key")


def test_a_4k_token_prompt_hashes_well_under_a_millisecond_per_page():
    h, prompt = hasher(), list(range(4096))
    start = time.perf_counter()
    keys = h.keys(prompt)
    per_page = (time.perf_counter() - start) / len(keys)
    assert per_page < 1e-4  # measured ~6e-7 s here; the bound leaves room for a busy box
