"""KvSender over a real tcp transfer engine: the decode side ends with the final pages."""

import pytest

from libs.common.transfer import create_engine
from libs.common.worker.handoff.protocol import KvLayout
from libs.common.worker.handoff.sender import KvSender

LAYERS, SLICE = 2, 8  # tiny pages: 2 layers x (K, V) x 8 bytes


def _pool(num_pages: int, fill) -> bytearray:
    layout = KvLayout(LAYERS, num_pages, SLICE)
    buf = bytearray(layout.offset(LAYERS, 0, 0))
    for page in range(num_pages):
        for layer in range(LAYERS):
            for kv in (0, 1):
                at = layout.offset(layer, kv, page)
                buf[at : at + SLICE] = bytes([fill(page, layer, kv)]) * SLICE
    return buf


def _page(buf: bytearray, layout: KvLayout, page: int) -> list[int]:
    return [buf[layout.offset(layer, kv, page)] for layer in range(LAYERS) for kv in (0, 1)]


@pytest.fixture
async def engines():
    a, b = create_engine("tcp", host="127.0.0.1"), create_engine("tcp", host="127.0.0.1")
    await a.start()
    await b.start()
    yield a, b
    await a.stop()
    await b.stop()


async def test_pages_sent_early_and_swapped_later_end_up_final_on_the_decode_side(engines):
    src_engine, dst_engine = engines
    local, remote = KvLayout(LAYERS, 8, SLICE), KvLayout(LAYERS, 6, SLICE)
    src = _pool(8, lambda p, layer, kv: 10 * p + 2 * layer + kv + 1)
    dst = _pool(6, lambda p, layer, kv: 0)
    sender = KvSender(
        src_engine, src_engine.register(src), local, dst_engine.register(dst), remote,
        num_prompt_pages=4, skip=1, remote_pages=[5, 2, 3],
    )  # fmt: skip
    sender.send([0, 1])  # chunk 1 done: prompt page 1 (local page 1) goes now
    # page 1 got swapped for its cached twin (local 6); pages 2 and 3 are new
    await sender.finish([0, 6, 4, 7])
    assert _page(dst, remote, 5) == _page(src, local, 6)
    assert _page(dst, remote, 2) == _page(src, local, 4)
    assert _page(dst, remote, 3) == _page(src, local, 7)
    assert _page(dst, remote, 0) == [0, 0, 0, 0]  # page 0 is the decode's own: untouched


def test_a_reservation_that_does_not_match_the_prompt_is_refused():
    with pytest.raises(ValueError, match="reserved"):
        KvSender(None, None, KvLayout(1, 4, 8), None, KvLayout(1, 4, 8),
                 num_prompt_pages=4, skip=1, remote_pages=[1, 2])  # fmt: skip
