"""ChunkOrder: a stream's chunks in index order, once each, ending at the final one."""

from libs.common.messages.control import TokenChunk
from services.router.dispatch.chunk_order import ChunkOrder


def chunk(index, ids, finish=None):
    return TokenChunk(request_id="r", index=index, token_ids=ids, worker="w",
                      finish_reason=finish)  # fmt: skip


def feed(chunks):
    order = ChunkOrder()
    return [c for x in chunks for c in order.push(x)]


def test_chunks_in_order_pass_at_once():
    out = feed([chunk(0, [1]), chunk(1, [2, 3]), chunk(3, [], "stop")])
    assert [c.index for c in out] == [0, 1, 3]


def test_out_of_order_chunks_are_held_until_the_hole_fills_and_duplicates_dropped():
    out = feed([chunk(3, [4, 5]), chunk(1, [2, 3]), chunk(0, [1]), chunk(1, [2, 3]),
                chunk(5, [], "length")])  # fmt: skip
    assert [c.index for c in out] == [0, 1, 3, 5]
    assert [t for c in out for t in c.token_ids] == [1, 2, 3, 4, 5]


def test_nothing_passes_after_the_final_chunk():
    assert [c.index for c in feed([chunk(0, [1], "stop"), chunk(1, [2])])] == [0]


def test_an_error_numbered_behind_the_order_still_ends_the_stream():
    out = feed([chunk(0, [1]), chunk(0, [], "error"), chunk(1, [2])])
    assert [c.finish_reason for c in out] == [None, "error"]


def test_an_empty_chunk_passes_without_moving_the_order():
    order = ChunkOrder()
    assert [c.index for c in order.push(chunk(0, []))] == [0]
    assert order.next_index == 0 and not order.held
    assert [c.index for c in order.push(chunk(0, [1], "stop"))] == [0]
