"""Messages: JSON with a schema version; bad input refused with the field named."""

import orjson
import pytest

from libs.common.messages.control import (
    SCHEMA_VERSION,
    ErrorReply,
    MessageError,
    ServiceInfo,
    TokenChunk,
    TokenChunkBatch,
)


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


def _chunk_variants() -> list[dict]:
    usual = {"request_id": "r1", "index": 3, "token_ids": [5, 6], "worker": "d0", "text": "hi"}
    changes = [
        {}, {"text": None}, {"finish_reason": "stop"}, {"finish_reason": 3}, {"error": "x"},
        {"error": 5}, {"index": "3"}, {"index": True}, {"index": 3.0}, {"token_ids": [5, True]},
        {"token_ids": [5.0]}, {"token_ids": "56"}, {"worker": 5}, {"request_id": None},
        {"logprobs": []}, {"logprobs": None}, {"logprobs": {}}, {"logprobs": ""}, {"logprobs": 0},
        {"logprobs": [{"token": 5, "logprob": -0.5, "top": []}]}, {"usage": None},
        {"usage": "x"}, {"usage": {"prompt_tokens": 4, "completion_tokens": 2}},
        {"v": SCHEMA_VERSION, "type": "token_chunk", "extra": 1},
    ]  # fmt: skip
    variants = [usual | change for change in changes]
    for name in ("request_id", "index", "token_ids", "worker", "text"):
        variants.append({k: v for k, v in usual.items() if k != name})
    return variants


def test_the_token_chunk_shortcut_accepts_and_builds_what_the_checked_path_does(monkeypatch):
    # The router decodes a TokenChunk per token per stream through TokenChunk.shortcut;
    # it must never accept what the per-field checks refuse, nor build anything else.
    def decode(obj: dict):
        try:
            return TokenChunk.from_dict(obj), TokenChunkBatch.from_dict(
                {"worker": "d0", "chunks": [obj]}
            )
        except MessageError as e:
            return type(e)

    variants = _chunk_variants()
    assert TokenChunk.shortcut(variants[0]) is not None  # the usual chunk takes it
    fast = [decode(v) for v in variants]
    monkeypatch.setattr(TokenChunk, "shortcut", classmethod(lambda cls, obj: None))
    checked = [decode(v) for v in variants]
    assert fast == checked
    # Both outcomes occur, and the shortcut's result is a fresh, independent chunk.
    assert MessageError in checked and any(c is not MessageError for c in checked)
    a, b = (TokenChunk.from_dict(variants[0]) for _ in range(2))
    a.logprobs.append({"token": 1})
    assert b.logprobs == []
