"""RegionDescriptor: plain JSON data, strictly validated when decoded."""

from __future__ import annotations

import pytest

from libs.common.transfer.descriptor import RegionDescriptor

TOKEN = "ab" * 16


def _desc(**kw) -> RegionDescriptor:
    base = dict(transport="rdma", endpoint="w1", region_id=7, length=4096, token=TOKEN,
                addr=0x7F00_0000_1000, rkey=0x1234)  # fmt: skip
    base.update(kw)
    return RegionDescriptor(**base)


def test_descriptor_round_trips_through_json() -> None:
    desc = _desc()
    assert RegionDescriptor.from_json(desc.to_json()) == desc
    assert RegionDescriptor.from_dict(desc.to_dict()) == desc


def test_descriptor_repr_does_not_leak_the_token() -> None:
    assert TOKEN not in repr(_desc())


@pytest.mark.parametrize(
    "field, value",
    [
        ("transport", "udp"),
        ("endpoint", ""),
        ("region_id", -1),
        ("length", True),
        ("length", 1 << 64),
        ("token", "zz" * 16),
        ("token", "ab"),
        ("rkey", 1 << 32),
    ],
)
def test_descriptor_rejects_bad_field(field: str, value: object) -> None:
    data = _desc().to_dict()
    data[field] = value
    with pytest.raises(ValueError, match=field):
        RegionDescriptor.from_dict(data)


def test_descriptor_rejects_unknown_version_fields_and_garbage() -> None:
    data = _desc().to_dict()
    with pytest.raises(ValueError, match="v"):
        RegionDescriptor.from_dict({**data, "v": 99})
    with pytest.raises(ValueError, match="unknown fields"):
        RegionDescriptor.from_dict({**data, "evil": 1})
    with pytest.raises(ValueError, match="missing"):
        RegionDescriptor.from_dict({"v": 1, "transport": "tcp"})
    with pytest.raises(ValueError, match="JSON"):
        RegionDescriptor.from_json(b"\x80not json")
    with pytest.raises(ValueError):
        RegionDescriptor.from_json(b"[1, 2]")
