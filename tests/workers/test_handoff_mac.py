"""The handoff MAC (worker/handoff/protocol.py): a decode worker's check of the KV bytes a prefill
worker wrote into its pages, over real TCP transfer engines on loopback."""

from __future__ import annotations

import os

import pytest

from libs.common.pool.integrity import KvMac
from libs.common.transfer.tcp.engine import TcpTransferEngine
from libs.common.worker.handoff.protocol import (
    HandoffClaim,
    KvLayout,
    handoff_mac,
    handoff_seed,
    kv_digest,
    page_copy_ops,
    verify_handoff,
)

LAYERS, SLICE = 3, 256
PREFILL = KvLayout(LAYERS, 10, SLICE)
DECODE = KvLayout(LAYERS, 16, SLICE)
KEY = KvMac(b"0123456789abcdef0123456789abcdef").handoff_key


def claim(pages, digest, **over):
    fields = dict(router="r1", request_id="7", decode_worker="d1", token_ids=[1, 2, 3],
                  page_indices=pages, first_token=42, digest=digest)  # fmt: skip
    return HandoffClaim(**{**fields, **over})


@pytest.fixture
async def engines():
    engines = [TcpTransferEngine(host="127.0.0.1", port=0, batch_timeout_s=10.0)
               for _ in range(3)]  # fmt: skip
    for e in engines:
        await e.start()
    try:
        yield engines
    finally:
        for e in engines:
            await e.stop()


def pool(engine, layout):
    view = engine.allocate(layout.num_layers * 2 * layout.num_pages * layout.slice_nbytes)
    return view, engine.register(view)


async def handoff(engines, local_pages=(2, 3, 7), remote_pages=(9, 10, 4)):
    """Prefill pages `local_pages` -> decode pages `remote_pages`: (prefill view, decode
    view, decode region, the prefill worker's MAC)."""
    prefill, decode, _ = engines
    pview, pregion = pool(prefill, PREFILL)
    pview[:] = os.urandom(pview.nbytes)
    dview, dregion = pool(decode, DECODE)
    ops = page_copy_ops(PREFILL, list(local_pages), DECODE, list(remote_pages))
    await prefill.write(pregion, dregion, ops)
    mac = handoff_mac(KEY, claim(list(remote_pages), kv_digest(pview, PREFILL, local_pages)))
    return pview, dview, dregion, mac


def test_the_digest_depends_on_the_secret_per_request_seed():
    data = bytearray(os.urandom(LAYERS * 2 * 10 * SLICE))
    seeds = {handoff_seed(KEY, "r1", rid, "d1") for rid in ("7", "8")}
    seeds.add(handoff_seed(KvMac(b"another secret of 32 bytes......").handoff_key, "r1", "7", "d1"))
    assert len({kv_digest(data, PREFILL, [1, 2], seed) for seed in seeds}) == 3


def test_the_digest_is_the_same_wherever_the_pages_sit_in_either_pool():
    a, b = bytearray(os.urandom(LAYERS * 2 * 10 * SLICE)), bytearray(LAYERS * 2 * 16 * SLICE)
    for lp, rp in ((4, 0), (5, 1), (1, 12)):
        for layer in range(LAYERS):
            for kv in (0, 1):
                s, d = PREFILL.offset(layer, kv, lp), DECODE.offset(layer, kv, rp)
                b[d : d + SLICE] = a[s : s + SLICE]
    assert kv_digest(a, PREFILL, [4, 5, 1]) == kv_digest(b, DECODE, [0, 1, 12])
    assert kv_digest(a, PREFILL, [4, 5, 1]) != kv_digest(a, PREFILL, [5, 4, 1])  # order counts


async def test_the_bytes_that_landed_verify_against_the_prefill_workers_mac(engines):
    _, dview, _, mac = await handoff(engines)
    got = claim([9, 10, 4], kv_digest(dview, DECODE, [9, 10, 4]))
    assert verify_handoff(KEY, got, mac)


async def test_a_forged_write_by_a_token_holder_fails_verification(engines):
    _, dview, dregion, mac = await handoff(engines)
    attacker = engines[2]
    src = attacker.register(bytearray(b"\x01" * 64))
    target = DECODE.offset(LAYERS - 1, 1, 10) + 100  # a few bytes of one page's V
    await attacker.write(src, dregion, [(0, target, 64)])
    got = claim([9, 10, 4], kv_digest(dview, DECODE, [9, 10, 4]))
    assert not verify_handoff(KEY, got, mac)


async def test_a_mac_does_not_verify_another_request_prompt_or_page_list(engines):
    _, dview, _, mac = await handoff(engines)
    digest = kv_digest(dview, DECODE, [9, 10, 4])
    for other in (dict(request_id="8"), dict(router="r2"), dict(token_ids=[1, 2, 4]),
                  dict(decode_worker="d2"), dict(first_token=43)):  # fmt: skip
        assert not verify_handoff(KEY, claim([9, 10, 4], digest, **other), mac), other
    other_key = KvMac(b"another secret of 32 bytes......").handoff_key
    assert not verify_handoff(other_key, claim([9, 10, 4], digest), mac)


async def test_with_a_secret_a_handoff_without_a_mac_fails_and_without_one_nothing_is_checked():
    from types import SimpleNamespace

    from libs.common.messages.control import GenerateRequest, PrefillResult, SamplingSpec
    from libs.common.worker.handoff.receiver import HandoffForged, verify_kv

    req = GenerateRequest(request_id="7", token_ids=[1, 2], sampling=SamplingSpec(),
                          stream_subject="s", prefill_worker="p1")  # fmt: skip
    result = PrefillResult(request_id="7", first_token=3, check="x", kv_mac="")
    with_secret = SimpleNamespace(kv_mac=KvMac(b"0123456789abcdef0123456789abcdef"))
    with pytest.raises(HandoffForged, match="sent no MAC"):
        await verify_kv(with_secret, req, [0], result)
    await verify_kv(SimpleNamespace(kv_mac=None), req, [0], result)  # dev mode: no check
