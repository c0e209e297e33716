"""Malformed and oversized messages on every subject a service listens to: each request gets
an error reply (never a crash, never a 500 from an unhandled exception, never silence),
each published message is logged and dropped, and afterwards every process is alive and
serves a valid request.

Subjects (docs/protocol.md): the micro endpoints of each service (`info`; decode
`generate`; prefill `prefill`; the master's `pool.master.*`, mount steps and `drop`
included) and the subscriptions
(`cancel` on the workers, `workers.*.*.load` on the router and decode, the store's
`pool.store.<id>.update`, the router's `kv.events.>` through JetStream, and the router's
two token-stream subscriptions `stream.<router-id>.*` and `chunks.<router-id>`, which stay
subscribed for all its requests: chunks for a request it does not have are dropped).
The subjects whose good message depends on the cluster's state (the store's `replicate`,
the masters' `epoch`, the routers' heartbeats) and a real mount's wrong steps are in
test_nats_pool.py, with checks that the state is untouched.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import nats
import orjson
import pytest

from libs.common.messages.control import (
    CancelRequest,
    GenerateRequest,
    InfoRequest,
    KvEvent,
    LoadReport,
    PrefillRequest,
    RequestStatus,
    SamplingSpec,
    ServiceInfo,
    TokenChunk,
    TokenChunkBatch,
)
from libs.common.messages.mounts import PoolMount, PoolMountChunk, PoolMountEnd, PoolMountPage
from libs.common.messages.pool import (
    PoolBadCopy,
    PoolDrop,
    PoolKeys,
    PoolNewObject,
    PoolPutFinish,
    PoolPutStart,
    PoolRecord,
    PoolStoreRef,
    PoolStoreUpdate,
)
from tests.hostile.conftest import PROCESSES, Hostile

pytestmark = pytest.mark.slow

MAX_PAYLOAD = 1 << 20  # nats-server's default; a client refuses to send more
SAMPLING = SamplingSpec(max_tokens=1, temperature=0)
KEY = "0" * 32
_RECORD = PoolRecord(KEY, 0, 64, "0" * 16, mac="")


def _generate() -> GenerateRequest:
    return GenerateRequest(request_id="hostile-gen", token_ids=[1, 2, 3], sampling=SAMPLING,
                           stream_subject="tandem.stream.hostile-gen", prefill_worker="p1",
                           timeout=10.0)  # fmt: skip


def _prefill() -> PrefillRequest:
    return PrefillRequest(request_id="hostile-pre", token_ids=[1, 2, 3], sampling=SAMPLING,
                          stream_subject="tandem.stream.hostile-pre", decode_worker="d1",
                          kv_region={}, page_indices=[0], skip_pages=0, model_id="x",
                          page_size=16, kv_dtype="float32", kv_num_pages=1,
                          timeout=10.0)  # fmt: skip


# subject -> a well-formed request of the kind it takes (its fields are then mutated)
REQUESTS = {
    **{f"tandem.{service}.{sid}.info": InfoRequest() for sid, (service, _) in PROCESSES.items()},
    "tandem.decode.d1.generate": _generate(),
    "tandem.prefill.p1.prefill": _prefill(),
    "tandem.prefill.p1.status": RequestStatus(request_id="hostile-none"),
    "tandem.pool.master.mount": PoolMount(store_id="evil", segment={}),
    "tandem.pool.master.unmount": PoolStoreRef(store_id="evil"),
    "tandem.pool.master.heartbeat": PoolStoreRef(store_id="evil"),
    "tandem.pool.master.put_start": PoolPutStart([PoolNewObject(KEY, 64, "0" * 16)]),
    "tandem.pool.master.put_end": PoolPutFinish(put_id="nope", keys=[KEY]),
    "tandem.pool.master.put_revoke": PoolPutFinish(put_id="nope", keys=[KEY]),
    "tandem.pool.master.get": PoolKeys(keys=[KEY]),
    "tandem.pool.master.exists": PoolKeys(keys=[KEY]),
    "tandem.pool.master.remove": PoolKeys(keys=["f" * 32]),
    "tandem.pool.master.stats": InfoRequest(),
    # an unknown mount id (tests/hostile/test_nats_pool.py: a real mount's wrong steps)
    "tandem.pool.master.mount_chunk": PoolMountChunk("evil", "nope", 1, [_RECORD]),
    "tandem.pool.master.mount_end": PoolMountEnd("evil", "nope", chunks=1, records=0),
    "tandem.pool.master.mount_page": PoolMountPage("evil", "nope", page=1),
    # matches no record: drops nothing
    "tandem.pool.master.drop": PoolDrop([PoolBadCopy(KEY, "s1", 0, "0" * 16, mac="")]),
}
# subject -> a well-formed message (None: only malformed ones are sent; a well-formed load
# report would enter a fake worker into rotation, which any NATS client may do: see
# docs/security.md)
PUBLISHED = {
    "tandem.cancel": CancelRequest(request_id="hostile-none"),
    "tandem.workers.prefill.evil.load": None,
    "tandem.workers.decode.evil.load": None,
    "tandem.pool.store.s1.update": PoolStoreUpdate(seq=0),
    "tandem.kv.events.evil": KvEvent(
        source="evil", seq=1, kind="stored", tier="device", keys=[KEY]
    ),
    "tandem.stream.router-h.hostile-none": TokenChunk(
        request_id="hostile-none", index=0, token_ids=[1], worker="evil"
    ),
    "tandem.chunks.router-h": TokenChunkBatch(
        worker="evil",
        chunks=[TokenChunk(request_id="hostile-none", index=0, token_ids=[1], worker="evil")],
    ),
}
_ = LoadReport  # documented above: the load subjects get malformed input only


def malformed() -> Iterator[tuple[str, bytes]]:
    """Bytes that are not a message of any kind."""
    yield "empty", b""
    yield "garbage", os.urandom(256)
    yield "invalid utf-8", b'{"v": 1, "type": "\xff\xfe"}'
    yield "truncated", b'{"v": 1, "type": "generate", "token_ids": [1, 2'
    for text in ("null", "[]", '"text"', "1e400", "true", "-1"):
        yield f"json {text}", text.encode()
    yield "deep nesting", b"[" * 100_000 + b"]" * 100_000
    # exactly nats-server's max_payload: the largest message the bus carries
    yield "huge", b'{"v": 1, "pad": "' + b"x" * (MAX_PAYLOAD - 19) + b'"}'
    # one byte more: the client refuses to send it (counted, and required)
    yield "over max_payload", b'{"v": 1, "pad": "' + b"x" * (MAX_PAYLOAD - 18) + b'"}'


def mutations(message) -> Iterator[tuple[str, bytes]]:
    """The wrong version and type, then each field in turn set to a wrong type or an
    extreme value of its own type."""
    body = message.to_dict()
    yield "schema version 999", orjson.dumps({**body, "v": 999})
    yield "another type", orjson.dumps({**body, "type": "nope"})
    for name, value in body.items():
        if name in ("v", "type"):
            continue
        for label, bad in _extremes(value):
            try:
                yield f"{name}={label}", orjson.dumps({**body, name: bad})
            except TypeError:  # an integer orjson cannot write: send it as raw text
                raw = orjson.dumps({**body, name: "@@"}).replace(b'"@@"', str(bad).encode())
                yield f"{name}={label}", raw


_WRONG = [("wrong type object", {"a": [1]}), ("null", None)]
_EXTREMES = {
    bool: [("string", "true")],
    int: [("-1", -1), ("-2**63", -(2**63)), ("2**63", 2**63), ("10**30", 10**30)],
    float: [("-1.0", -1.0), ("1e308", 1e308), ("0", 0.0)],
    str: [("empty", ""), ("300k chars", "x" * 300_000), ("subject wildcards", "a b.*.>"),
          ("NUL", "\x00\n")],
    list: [("empty list", []), ("100k ints", [2**31] * 100_000), ("nested", [[[]]]),
           ("100k strings", ["k"] * 100_000)],
    dict: [("empty object", {}), ("nested", {"a": {"b": {"c": []}}})],
}  # fmt: skip


def _extremes(value) -> list[tuple[str, object]]:
    return [*_WRONG, *_EXTREMES.get(type(value), [])]


def _must_refuse(label: str, message) -> bool:
    """Whether input `label` (of `malformed` or `mutations(message)`) is invalid for the
    subject that takes `message`: not a message at all, the wrong schema version or type
    tag, a field of the wrong type. Extreme values of the right type may be valid. An
    empty body reads as `{}`, and the type tag may be left out (schema.py), so `empty`
    and `huge` (a version and an unknown field) are valid where `{}` is (`info`,
    `stats`); an object is the right type for a field that holds a record."""
    if label in ("schema version 999", "another type"):
        return True
    if label.endswith("=wrong type object"):
        return not isinstance(message.to_dict()[label.split("=")[0]], dict)
    if label in ("empty", "huge"):
        try:
            type(message).decode(b"{}")
        except ValueError:
            return True
        return False
    return label in {name for name, _ in malformed()}


async def _check_alive(hostile: Hostile, nc) -> None:
    assert not hostile.dead(), f"exited: {hostile.dead()}"
    for sid, (service, _) in PROCESSES.items():
        reply = await nc.request(f"tandem.{service}.{sid}.info", InfoRequest().encode(), timeout=10)
        assert ServiceInfo.decode(reply.data).service_id == sid
    await hostile.completion_works()


async def fuzz_request(nc, subject: str, message) -> None:
    """Send every malformed input and every mutation of `message` to `subject`: each must
    be answered, any error a 4xx, and every input that `_must_refuse` names refused."""
    assert nc.max_payload == MAX_PAYLOAD  # `huge` is exactly the largest message
    cases = [*malformed(), *mutations(message)]
    failures, answered, refused, too_big = [], 0, 0, 0
    for label, payload in cases:
        if len(payload) > nc.max_payload:  # the bus cannot carry it: the client refuses
            with pytest.raises(nats.errors.MaxPayloadError):
                await nc.request(subject, payload, timeout=20)
            too_big += 1
            continue
        try:
            reply = await nc.request(subject, payload, timeout=20)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as e:
            failures.append(f"{label}: no reply ({type(e).__name__})")
            continue
        answered += 1
        code = (reply.headers or {}).get("Nats-Service-Error-Code")
        if code is not None:
            refused += 1
            if not code.isdigit() or not 400 <= int(code) < 500:
                failures.append(f"{label}: error {code}: {reply.headers.get('Nats-Service-Error')}")
        elif _must_refuse(label, message):
            failures.append(f"{label}: accepted ({len(payload)} bytes), must be refused")
    print(f"nats {subject}: {answered} inputs answered, {refused} refused with 4xx, "
          f"{too_big} over max_payload refused by the client, {len(failures)} bad")  # fmt: skip
    assert not failures, "\n".join(failures)
    assert too_big >= 1 and answered + too_big == len(cases)
    must = sum(_must_refuse(label, message) for label, p in cases if len(p) <= MAX_PAYLOAD)
    assert refused >= must > 0, (refused, must)


async def fuzz_publish(nc, subject: str, message) -> None:
    """Publish every malformed input (and every mutation of `message`, unless None)."""
    cases = [*malformed(), *(mutations(message) if message is not None else [])]
    sent, too_big = 0, 0
    for _label, payload in cases:
        if len(payload) > nc.max_payload:  # the bus cannot carry it: the client refuses
            with pytest.raises(nats.errors.MaxPayloadError):
                await nc.publish(subject, payload)
            too_big += 1
        else:
            await nc.publish(subject, payload)
            sent += 1
    assert too_big >= 1 and sent + too_big == len(cases)
    await nc.flush()
    await asyncio.sleep(1.0)  # let every subscriber read them
    print(f"nats {subject}: {sent} inputs published, {too_big} over max_payload refused")


@pytest.mark.parametrize("subject", list(REQUESTS))
async def test_bad_request_gets_an_error_reply_and_the_service_keeps_serving(
    hostile: Hostile, nc, subject
):
    await fuzz_request(nc, subject, REQUESTS[subject])
    await _check_alive(hostile, nc)


@pytest.mark.parametrize("subject", list(PUBLISHED))
async def test_bad_published_message_is_dropped_and_the_service_keeps_serving(
    hostile: Hostile, nc, subject
):
    await fuzz_publish(nc, subject, PUBLISHED[subject])
    await _check_alive(hostile, nc)
