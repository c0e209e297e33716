"""Messages: JSON with a schema version; bad input refused with the field named, in the same
words whatever the message, wherever it is nested, whichever subject it came on."""

import orjson
import pytest

from libs.common.messages import control, mounts, pins, pool
from libs.common.messages.control import (
    SCHEMA_VERSION,
    ErrorReply,
    Message,
    MessageError,
    RdmaConnect,
    ServiceInfo,
    TokenChunk,
    TokenChunkBatch,
    encode_chunk_batch,
)
from libs.common.messages.mounts import PoolMount
from libs.common.messages.pool import (
    PoolCount,
    PoolFound,
    PoolGetReply,
    PoolPutStartReply,
    PoolReplica,
)


def _info() -> ServiceInfo:
    return ServiceInfo(
        service="router", service_id="r1", version="0.1.0", started_at=1.5,
        nats_url="nats://h:1", details={"port": 8000},
    )  # fmt: skip


def _error(kind: type[Message], obj: object) -> str:
    with pytest.raises(MessageError) as e:
        kind.decode(orjson.dumps(obj))
    return str(e.value)


def _chunk(**change) -> dict:
    usual = {"request_id": "r1", "index": 3, "token_ids": [5, 6], "worker": "d0", "text": "hi"}
    return {"v": SCHEMA_VERSION, "type": "token_chunk", **usual, **change}


def test_round_trip_keeps_every_field():
    info = _info()
    assert ServiceInfo.decode(info.encode()) == info


def test_encoded_form_is_plain_json_with_version_and_type():
    obj = orjson.loads(_info().encode())
    assert obj["v"] == SCHEMA_VERSION and obj["type"] == "service_info"
    assert obj == _info().to_dict()


def test_every_message_class_has_its_own_type_tag():
    kinds = [k for m in (control, pool, mounts, pins) for k in vars(m).values()
             if isinstance(k, type) and issubclass(k, Message) and k is not Message]  # fmt: skip
    tags = [k.TYPE for k in kinds]
    assert len(kinds) > 20 and "message" not in tags
    assert len(set(tags)) == len(tags)


def test_unknown_schema_version_is_refused_at_any_depth():
    text = _error(ServiceInfo, _info().to_dict() | {"v": SCHEMA_VERSION + 1})
    assert text == f"service_info.v: schema version {SCHEMA_VERSION + 1} not supported (this " \
        f"build speaks {SCHEMA_VERSION})"  # fmt: skip
    batch = {"worker": "d0", "chunks": [_chunk(), _chunk(v=SCHEMA_VERSION + 1)]}
    assert "token_chunk_batch.chunks[1].v: schema version" in _error(TokenChunkBatch, batch)


def test_unknown_or_wrong_message_type_is_refused():
    wrong = ErrorReply(code=1, message="m").encode()
    with pytest.raises(MessageError, match="expected message type 'service_info', got 'error'"):
        ServiceInfo.decode(wrong)
    text = _error(TokenChunk, _chunk(type="no_such_type"))
    assert text == "token_chunk.type: expected message type 'token_chunk', got 'no_such_type'"
    batch = {"worker": "d0", "chunks": [_chunk(type="usage")]}
    assert _error(TokenChunkBatch, batch).startswith("token_chunk_batch.chunks[0].type:")


def test_missing_and_mistyped_fields_are_named():
    obj = _info().to_dict()
    del obj["service_id"]
    assert _error(ServiceInfo, obj) == "service_info.service_id: required field missing"
    text = _error(ServiceInfo, _info().to_dict() | {"started_at": "yesterday"})
    assert text.startswith("service_info.started_at: ")
    assert _error(ErrorReply, {"code": True, "message": "x"}).startswith("error.code: ")


def test_a_bad_field_reads_the_same_alone_and_nested():
    # The same chunk, wrong in the same way, sent alone (stream subject) or in a batch
    # (chunks subject): the same words after the path.
    for change in ({"index": "3"}, {"index": True}, {"token_ids": [5, 1.5]}, {"usage": "x"},
                   {"finish_reason": 3}, {"logprobs": {}}):  # fmt: skip
        alone = _error(TokenChunk, _chunk(**change))
        nested = _error(TokenChunkBatch, {"worker": "d0", "chunks": [_chunk(), _chunk(**change)]})
        assert alone.startswith("token_chunk.")
        assert nested == "token_chunk_batch.chunks[1]." + alone.removeprefix("token_chunk.")


def test_the_same_wrong_type_reads_the_same_in_control_and_pool_messages():
    # One decoder: an int field given a string says the same in every message.
    control_text = _error(ErrorReply, {"code": "7", "message": "m"})
    pool_text = _error(PoolCount, {"count": "7"})
    assert control_text.removeprefix("error.code") == pool_text.removeprefix("pool_count.count")
    missing = _error(PoolCount, {}), _error(ErrorReply, {"message": "m"})
    assert missing == ("pool_count.count: required field missing",
                       "error.code: required field missing")  # fmt: skip


def test_decode_rejects_wrong_types_inside_nested_records():
    segment = {"transport": "tcp"}
    good = PoolGetReply([PoolFound(64, "0" * 16, [PoolReplica("s1", 0)])], {"s1": segment})
    assert PoolGetReply.decode(good.encode()) == good
    body = good.to_dict()
    cases = {
        "pool_get_reply.objects[0].size": {"size": "64"},
        "pool_get_reply.objects[0].checksum": {"checksum": 5},
        "pool_get_reply.objects[0].replicas[0].offset": {"replicas": [{"store": "s1",
                                                                       "offset": True}]},
        "pool_get_reply.objects[0].replicas[0].store": {"replicas": [{"offset": 0}]},
        "pool_get_reply.objects[0].replicas": {"replicas": {"s1": 0}},
    }  # fmt: skip
    for path, change in cases.items():
        bad = {**body, "objects": [{**body["objects"][0], **change}]}
        assert _error(PoolGetReply, bad).startswith(path + ":"), change
    records = {
        "store_id": "s",
        "segment": {},
        "records": [{"key": "k", "offset": 0, "size": 1, "checksum": None}],
    }
    assert _error(PoolMount, records).startswith("pool_mount.records[0].checksum: ")


def test_a_replica_on_a_store_without_a_segment_is_refused():
    reply = {"put_id": "p", "slots": [{"status": "ok", "replicas": [{"store": "s9", "offset": 0}]}],
             "segments": {}}  # fmt: skip
    assert "store 's9' has no segment" in _error(PoolPutStartReply, reply)


def test_garbage_bytes_raise_message_error_not_crash():
    for data in (b"\x00\xff", b"[1,2]", b"null", b"", b"{", b'{"type": "error"}',
                 b"[" * 100_000 + b"]" * 100_000, b'{"v": 1, "type": "\xff\xfe"}'):  # fmt: skip
        with pytest.raises(MessageError):
            ServiceInfo.decode(data)
    deep = b'{"exchange": {"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}"  # in an Any field
    with pytest.raises(MessageError, match="nested too deeply"):
        RdmaConnect.decode(deep)


def test_a_chunk_batch_holds_the_chunks_as_sent():
    chunks = [TokenChunk("r1", 0, [1], "d0", "a"), TokenChunk("r2", 4, [2, 3], "d0", "bc",
                                                                finish_reason="stop")]  # fmt: skip
    data = encode_chunk_batch("d0", [c.encode() for c in chunks])
    assert TokenChunkBatch.decode(data) == TokenChunkBatch("d0", chunks)
    assert orjson.loads(data)["chunks"][1] == orjson.loads(chunks[1].encode())


def test_decoded_defaults_are_fresh_per_message():
    a, b = (TokenChunk.decode(orjson.dumps(_chunk())) for _ in range(2))
    a.logprobs.append({"token": 1})
    assert b.logprobs == []


def test_request_keys_travel_and_an_older_senders_messages_still_decode():
    spec = control.SamplingSpec()
    req = control.GenerateRequest(request_id="7", token_ids=[1], sampling=spec,
                                  stream_subject="s", router="ab12", label="client-id")  # fmt: skip
    back = control.GenerateRequest.decode(req.encode())
    assert (back.router, back.label, back.request_id) == ("ab12", "client-id", "7")
    # A sender from before these fields (a direct client): keyed by request_id alone.
    old = {"type": "cancel", "v": SCHEMA_VERSION, "request_id": "7"}
    assert control.CancelRequest.decode(orjson.dumps(old)).router == ""
    old = {"type": "request_status", "v": SCHEMA_VERSION, "request_id": "7"}
    assert control.RequestStatus.decode(orjson.dumps(old)).router == ""


def test_router_heartbeat_round_trips_and_refuses_a_bad_field():
    beat = control.RouterHeartbeat(router="ab12", service_id="r1", interval=0.5, timeout=2.0,
                                   timestamp=1.0)  # fmt: skip
    assert control.RouterHeartbeat.decode(beat.encode()) == beat
    bad = {**beat.to_dict(), "timeout": "soon"}
    assert _error(control.RouterHeartbeat, bad) == (
        "router_heartbeat.timeout: Expected `float`, got `str`"
    )
