"""Messages: JSON with a schema version; bad input refused with the field named."""

import orjson
import pytest

from libs.common.messages import SCHEMA_VERSION, ErrorReply, MessageError, ServiceInfo


def _info() -> ServiceInfo:
    return ServiceInfo(
        service="router", service_id="r1", version="0.1.0", started_at=1.5,
        nats_url="nats://h:1", details={"port": 8000},
    )  # fmt: skip


def test_round_trip_keeps_every_field():
    info = _info()
    assert ServiceInfo.decode(info.encode()) == info


def test_encoded_form_is_plain_json_with_version_and_type():
    obj = orjson.loads(_info().encode())
    assert obj["v"] == SCHEMA_VERSION and obj["type"] == "service_info"


def test_unknown_schema_version_is_refused():
    obj = _info().to_dict() | {"v": SCHEMA_VERSION + 1}
    with pytest.raises(MessageError, match="schema version"):
        ServiceInfo.from_dict(obj)


def test_missing_and_mistyped_fields_are_named():
    obj = _info().to_dict()
    del obj["service_id"]
    with pytest.raises(MessageError, match="service_id"):
        ServiceInfo.from_dict(obj)
    with pytest.raises(MessageError, match="started_at"):
        ServiceInfo.from_dict(_info().to_dict() | {"started_at": "yesterday"})
    with pytest.raises(MessageError, match="code"):
        ErrorReply.from_dict({"code": True, "message": "x"})


def test_garbage_bytes_raise_message_error_not_crash():
    for data in (b"\x00\xff", b"[1,2]", b"null", b'{"type": "error"}'):
        with pytest.raises(MessageError):
            ServiceInfo.decode(data)


def test_wrong_message_type_is_refused():
    with pytest.raises(MessageError, match="expected message type"):
        ServiceInfo.decode(ErrorReply(code=1, message="m").encode())
