"""The TCP server's admission policy alone (pure, no sockets): per-IP and total caps, and
which connection gives way (tcp/admission.py)."""

from __future__ import annotations

import pytest

from libs.common.transfer.tcp.admission import Admission, PeerConnection, ServerLimits


def _conn(ip: str, n: int, proven: bool = False) -> PeerConnection:
    return PeerConnection(sock=None, ip=ip, name=f"{ip}:{n}", proven=proven)


def test_over_the_per_ip_cap_a_newcomer_replaces_that_ips_oldest_unproven_connection() -> None:
    table = Admission(max_total=100, max_per_ip=3)
    first = [_conn("10.0.0.1", i) for i in range(3)]
    assert all(table.admit(c) == (True, None) for c in first)
    other = _conn("10.0.0.2", 0)
    assert table.admit(other) == (True, None)  # another IP has its own cap
    first[0].proven = True
    new = _conn("10.0.0.1", 9)
    assert table.admit(new) == (True, first[1])  # the oldest *unproven* one of that IP
    assert table.count("10.0.0.1") == 3 and len(table) == 4
    table.release(first[1])  # its thread ends later: a no-op
    assert table.count("10.0.0.1") == 3


def test_proven_connections_are_never_evicted_and_the_excess_is_refused() -> None:
    table = Admission(max_total=100, max_per_ip=2)
    proven = [_conn("10.0.0.1", i, proven=True) for i in range(2)]
    for c in proven:
        table.admit(c)
    assert table.admit(_conn("10.0.0.1", 5)) == (False, None)
    assert table.all() == proven
    table.release(proven[0])
    assert table.admit(_conn("10.0.0.1", 6))[0] is True


def test_over_the_total_cap_the_oldest_unproven_connection_of_any_ip_gives_way() -> None:
    table = Admission(max_total=3, max_per_ip=3)
    a = _conn("10.0.0.1", 0, proven=True)
    b = _conn("10.0.0.2", 0)
    c = _conn("10.0.0.3", 0)
    for x in (a, b, c):
        table.admit(x)
    d = _conn("10.0.0.4", 0)
    assert table.admit(d) == (True, b)
    b2 = _conn("10.0.0.2", 1)
    c.proven = d.proven = True
    assert table.admit(b2) == (False, None)  # everyone is proven: refused
    assert table.count("10.0.0.2") == 0 and len(table) == 3


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"first_frame_s": 0}, "first_frame_timeout_s"),
        ({"frame_s": -1}, "frame_timeout_s"),
        ({"max_connections": 0}, "max_server_connections"),
        ({"max_per_ip": 0}, "max_connections_per_ip"),
    ],
)
def test_bad_limits_raise_value_error_naming_the_option(kwargs, flag) -> None:
    with pytest.raises(ValueError, match=flag):
        ServerLimits(**kwargs)


def test_a_payload_gets_the_frame_timeout_plus_a_second_per_mib() -> None:
    limits = ServerLimits(first_frame_s=2.0, frame_s=4.0)
    assert limits.payload_budget(0) == 4.0
    assert limits.payload_budget(3 << 20) == 7.0
    assert limits.tick_s == 0.25  # deadlines are checked 8 times per shortest one
