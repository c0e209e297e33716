"""Pure parts of the rdma transport: QP exchange messages, link states, WR accounting."""

from __future__ import annotations

import pytest

from libs.common.transfer.rdma.link import Link, LinkState, QpExchange, QpInfo, WorkTracker

QP = QpInfo(qpn=0x12, psn=0xABCDEF, lid=3, gid="fe80" + "0" * 28, mtu=5)


def test_qp_exchange_round_trips_as_plain_data() -> None:
    request = QpExchange("prefill-1", (QP, QP), region_id=42, token="cd" * 16)
    assert QpExchange.from_dict(request.to_dict()) == request
    assert "cd" * 16 not in repr(request)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"v": 2}, "v"),
        ({"engine_id": ""}, "engine_id"),
        ({"qps": []}, "qps"),
        ({"qps": [{**QP.to_dict(), "psn": 1 << 24}]}, "psn"),
        ({"qps": [{**QP.to_dict(), "gid": "xyz"}]}, "gid"),
        ({"qps": [{**QP.to_dict(), "mtu": True}]}, "mtu"),
        ({"token": "00"}, "token"),
        ({"region_id": -1}, "region_id"),
    ],
)
def test_qp_exchange_rejects_bad_input(change: dict, match: str) -> None:
    data = {**QpExchange("w", (QP,)).to_dict(), **change}
    with pytest.raises(ValueError, match=match):
        QpExchange.from_dict(data)


def test_link_follows_its_state_machine() -> None:
    link = Link("decode-0")
    link.move(LinkState.CONNECTING)
    link.move(LinkState.IDLE, "exchange timed out")  # failed connect: retry later
    link.move(LinkState.CONNECTING)
    link.move(LinkState.READY)
    assert link.usable
    with pytest.raises(RuntimeError, match="ready -> connecting"):
        link.move(LinkState.CONNECTING)
    link.move(LinkState.ERROR, "wc status 12")
    assert not link.usable and link.reason == "wc status 12"
    link.move(LinkState.CONNECTING)
    link.move(LinkState.CLOSED)
    with pytest.raises(RuntimeError):
        link.move(LinkState.IDLE)


def test_work_tracker_completes_a_batch_when_all_wrs_are_done() -> None:
    tracker = WorkTracker()
    tracker.open(1, 3)
    wrs = [tracker.post(1, op) for op in (0, 0, 1)]
    assert tracker.complete(wrs[0], True) is None
    assert tracker.complete(wrs[2], True) is None
    done = tracker.complete(wrs[1], True)
    assert done is not None and done[0] == 1 and done[1].error is None
    assert tracker.outstanding == 0


def test_work_tracker_reports_the_first_failed_op() -> None:
    tracker = WorkTracker()
    tracker.open(7, 3)
    wrs = [tracker.post(7, op) for op in (0, 1, 2)]
    tracker.complete(wrs[1], False, "remote access error")
    tracker.complete(wrs[2], False, "flushed")
    _, batch = tracker.complete(wrs[0], True)
    assert (batch.error, batch.op_index) == ("remote access error", 1)
    assert tracker.complete(wrs[0], True) is None  # duplicate/late completion ignored
    with pytest.raises(ValueError, match="count"):
        tracker.open(8, 0)
