"""Bus identities on a real nats-server: each role says only what its allow lists let it.

The server runs with scripts/identities.py's nats-auth.conf; clients connect with their
credentials files exactly as services do (`connect_options`). A refused publish never
reaches a subscriber and the sender hears a permissions violation; a refused subscription
gets nothing. The pool master is the real service, in this process.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from libs.common.bus.connection import Bus, settle
from libs.common.bus.credentials import connect_options
from libs.common.bus.permissions import (
    CLIENT_CALLS,
    PIN_CALLS,
    STORE_CALLS,
    election_bucket,
    permissions,
    responses_bucket,
)
from libs.common.messages.pins import PoolPin, PoolPinInfo, PoolPinList
from libs.common.messages.pool import PoolCount, PoolKeys
from libs.common.messages.responses import StoredResponse
from scripts.identities import AUTH_CONF, Identity, ensure
from scripts.nats_server import NatsServer
from services.cache_master.config import CacheMasterConfig
from services.cache_master.service import CacheMasterService
from services.router.config import RouterConfig
from services.router.requests.stored import ResponseStore

IDENTITIES = (
    Identity("router", "router", "router-1"),
    Identity("master", "cache_master", "master-1"),
    Identity("store", "cache_store", "store-1"),
    Identity("prefill", "prefill", "prefill-1"),
    Identity("decode", "decode", "decode-1"),
    Identity("cli", "cli"),
)
QUIET = 0.3  # long enough for a message that was let through to arrive on loopback


class Secured:
    """A nats-server with one user per identity; `connect(name)` as that identity."""

    def __init__(self, server: NatsServer, files: dict[str, Path]):
        self.server, self.files = server, files
        self.clients: list[Client] = []
        self.errors: dict[str, list[str]] = {}

    async def connect(self, name: str) -> Client:
        errors = self.errors.setdefault(name, [])

        async def on_error(e: Exception) -> None:
            errors.append(str(e))

        options = connect_options(self.server.url, str(self.files[name]))
        nc = await nats.connect(self.server.url, error_cb=on_error, allow_reconnect=False,
                                connect_timeout=5, **options)  # fmt: skip
        self.clients.append(nc)
        return nc

    def refused(self, name: str, what: str, subject: str) -> bool:
        want = f'permissions violation for {what} to "{subject}"'.lower()  # as nats-py says it
        return any(want in e.lower() for e in self.errors.get(name, []))

    async def wait_refused(self, name: str, what: str, subject: str) -> bool:
        """Whether the server told `name` it refused (its -ERR arrives asynchronously)."""
        for _ in range(20):
            if self.refused(name, what, subject):
                return True
            await asyncio.sleep(0.05)
        return False


@pytest.fixture
async def secured(tmp_path: Path):
    files = ensure(tmp_path / "secrets", IDENTITIES)
    server = NatsServer(tmp_path / "nats", config_file=tmp_path / "secrets" / AUTH_CONF).start()
    bus = Secured(server, files)
    try:
        yield bus
    finally:
        for nc in bus.clients:
            await nc.close()
        server.stop()


@pytest.fixture
async def master(secured: Secured):
    config = CacheMasterConfig(nats_url=secured.server.url, service_id="master-1",
                               nats_credentials_file=str(secured.files["master"]))  # fmt: skip
    service = CacheMasterService(config)
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


async def _received(nc: Client, subject: str) -> list:
    got: list = []

    async def keep(msg) -> None:
        got.append(msg)

    await nc.subscribe(subject, cb=keep)
    await settle(nc)  # on the server now: one flush is not enough with nats-py
    return got


async def _publish_and_wait(nc: Client, subject: str, got: list) -> None:
    """Publish `{}` on `subject` once; it must reach `got` within 5 s."""
    await nc.publish(subject, b"{}")
    await nc.flush()
    for _ in range(100):
        if got:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the message published on {subject} did not arrive in 5 s")


async def test_a_router_identity_cannot_mount_or_remove(secured, master):
    router = await secured.connect("router")
    for call in ("mount", "remove", "heartbeat", "put_start"):
        subject = f"tandem.pool.master.{call}"
        with pytest.raises(nats.errors.TimeoutError):  # nats-server dropped it: no reply
            await router.request(subject, PoolKeys(["0" * 32]).encode(), timeout=0.5)
        assert await secured.wait_refused("router", "publish", subject), secured.errors["router"]


async def test_a_store_identity_reaches_mount_and_a_worker_reaches_remove(secured, master):
    store, decode = await secured.connect("store"), await secured.connect("decode")
    reply = await store.request("tandem.pool.master.mount", b"{}", timeout=5)
    assert reply.headers["Nats-Service-Error-Code"] == "400"  # the master read it: bad mount
    reply = await decode.request("tandem.pool.master.remove", PoolKeys(["0" * 32]).encode())
    assert PoolCount.decode(reply.data).count == 0
    assert not secured.errors["store"] and not secured.errors["decode"]


async def test_a_worker_cannot_mount_nor_a_store_remove(secured, master):
    store, decode = await secured.connect("store"), await secured.connect("decode")
    with pytest.raises(nats.errors.TimeoutError):
        await decode.request("tandem.pool.master.mount", b"{}", timeout=0.5)
    with pytest.raises(nats.errors.TimeoutError):
        await store.request("tandem.pool.master.remove", PoolKeys([]).encode(), timeout=0.5)
    assert await secured.wait_refused("decode", "publish", "tandem.pool.master.mount")
    assert await secured.wait_refused("store", "publish", "tandem.pool.master.remove")


async def test_only_the_master_may_answer_pool_requests(secured):
    for name in ("router", "store", "decode", "cli"):
        nc = await secured.connect(name)
        got = await _received(nc, "tandem.pool.master.get")
        assert await secured.wait_refused(name, "subscription", "tandem.pool.master.get"), name
        assert got == []


async def test_a_worker_publishes_its_own_load_report_only(secured):
    router, decode = await secured.connect("router"), await secured.connect("decode")
    got = await _received(router, "tandem.workers.*.*.load")
    own = "tandem.workers.decode.decode-1.load"
    others = ("tandem.workers.decode.decode-2.load", "tandem.workers.prefill.decode-1.load")
    for subject in (*others, "tandem.kv.events.decode-2", "tandem.kv.events.decode-1"):
        await decode.publish(subject, b"{}")
    await _publish_and_wait(decode, own, got)
    await asyncio.sleep(QUIET)  # and time for a refused one to show up if let through
    assert [m.subject for m in got] == [own]
    assert await secured.wait_refused("decode", "publish", "tandem.workers.decode.decode-2.load")
    assert await secured.wait_refused("decode", "publish", "tandem.workers.prefill.decode-1.load")
    assert await secured.wait_refused("decode", "publish", "tandem.kv.events.decode-2")


async def test_only_routers_send_generate_and_cancel(secured):
    decode, router = await secured.connect("decode"), await secured.connect("router")
    prefill = await secured.connect("prefill")
    generate = await _received(decode, "tandem.decode.decode-1.generate")
    cancel = await _received(decode, "tandem.cancel")
    await prefill.publish("tandem.decode.decode-1.generate", b"{}")
    await prefill.publish("tandem.cancel", b"{}")
    await prefill.flush()
    await _publish_and_wait(router, "tandem.decode.decode-1.generate", generate)
    await _publish_and_wait(router, "tandem.cancel", cancel)
    await asyncio.sleep(QUIET)
    assert len(generate) == 1 and len(cancel) == 1
    assert await secured.wait_refused("prefill", "publish", "tandem.decode.decode-1.generate")
    assert await secured.wait_refused("prefill", "publish", "tandem.cancel")
    assert not secured.errors["router"]


async def test_the_cli_reads_events_and_service_info_and_nothing_else(secured, master):
    from libs.common.bus.connection import discover

    cli, decode = await secured.connect("cli"), await secured.connect("decode")
    events = await _received(cli, "tandem.kv.events.>")
    await _publish_and_wait(decode, "tandem.kv.events.decode-1", events)
    info = await cli.request("tandem.cache_master.master-1.info", b"{}", timeout=5)
    assert b'"service_id":"master-1"' in info.data
    assert "tandem-cache_master" in {r["name"] for r in await discover(cli, timeout=0.3)}
    await cli.publish("tandem.decode.decode-1.generate", b"{}")
    await cli.publish("tandem.pool.master.remove", b"{}")
    for subject in ("tandem.stream.>", "tandem.pool.store.*.update", "_INBOX.>"):
        await _received(cli, subject)
    await cli.flush()
    await asyncio.sleep(QUIET)
    assert len(events) == 1  # the refused publishes and subscriptions added none
    assert await secured.wait_refused("cli", "publish", "tandem.decode.decode-1.generate")
    assert await secured.wait_refused("cli", "publish", "tandem.pool.master.remove")
    for subject in ("tandem.stream.>", "tandem.pool.store.*.update", "_INBOX.>"):
        assert await secured.wait_refused("cli", "subscription", subject), subject


async def test_an_identity_cannot_read_another_identitys_replies(secured):
    prefill = await secured.connect("prefill")
    await _received(prefill, "_INBOX.decode.>")
    await asyncio.sleep(QUIET)
    assert await secured.wait_refused("prefill", "subscription", "_INBOX.decode.>")


async def test_no_credentials_or_a_wrong_password_is_refused(secured, tmp_path):
    with pytest.raises(Exception, match=r"[Aa]uthorization"):
        await nats.connect(secured.server.url, allow_reconnect=False, connect_timeout=2)
    wrong = tmp_path / "wrong.credentials"
    wrong.write_text("router:not-the-password\n")
    with pytest.raises(Exception, match=r"[Aa]uthorization"):
        await nats.connect(secured.server.url, allow_reconnect=False, connect_timeout=2,
                           **connect_options(secured.server.url, str(wrong)))  # fmt: skip


def test_every_master_endpoint_has_its_callers():
    config = CacheMasterConfig(service_id="master-1")
    served = {ep.name for ep in CacheMasterService(config).pool_endpoints()}
    assert served == set(STORE_CALLS) | set(CLIENT_CALLS) | set(PIN_CALLS), (
        "a new master endpoint: add it to STORE_CALLS, CLIENT_CALLS or PIN_CALLS in "
        "libs/common/bus/permissions.py"
    )


async def test_the_cli_replays_the_kv_events_stream_but_cannot_delete_it(secured, master):
    cli, decode = await secured.connect("cli"), await secured.connect("decode")
    await decode.publish("tandem.kv.events.decode-1", b"{}")
    await decode.flush()
    got: list = []

    async def keep(msg) -> None:
        got.append(msg.subject)

    js = cli.jetstream(timeout=1)
    await js.subscribe("tandem.kv.events.>", cb=keep, ordered_consumer=True)
    for _ in range(40):
        if got:
            break
        await asyncio.sleep(0.05)
    assert got == ["tandem.kv.events.decode-1"]
    with pytest.raises(nats.errors.TimeoutError):
        await js.delete_stream("TANDEM_KV_EVENTS")
    assert await secured.wait_refused("cli", "publish", "$JS.API.STREAM.DELETE.TANDEM_KV_EVENTS")


def test_a_both_worker_serves_prefill_and_reports_load_as_both():
    both = permissions("both", "w", scope="w-1")
    assert {"tandem.prefill.w-1.prefill", "tandem.decode.w-1.generate"} <= set(both.subscribe)
    assert "tandem.workers.both.w-1.load" in both.publish
    assert not [s for s in both.publish if s.startswith("tandem.workers.decode.")]


def _allowed(patterns: tuple[str, ...], subject: str) -> bool:
    """NATS subject matching: `*` one token, `>` the rest."""
    for pattern in patterns:
        want, have = pattern.split("."), subject.split(".")
        if want[-1] == ">" and len(have) >= len(want):
            want, have = want[:-1], have[: len(want) - 1]
        if len(want) == len(have) and all(w in ("*", h) for w, h in zip(want, have, strict=True)):
            return True
    return False


def test_every_store_endpoint_is_served_by_its_store_and_called_by_the_master():
    from services.cache_store.config import CacheStoreConfig
    from services.cache_store.service import CacheStoreService

    store = permissions("cache_store", "store", scope="store-1")
    master = permissions("cache_master", "master")
    other = permissions("cache_store", "store2", scope="store-2")
    for ep in CacheStoreService(CacheStoreConfig(service_id="store-1")).endpoints():
        assert _allowed(store.subscribe, ep.subject), ep.subject
        assert _allowed(master.publish, ep.subject), ep.subject
        assert not _allowed(other.subscribe, ep.subject), ep.subject


def test_only_the_owners_of_a_transfer_engine_exchange_queue_pairs():
    for role in ("router", "cache_master", "cli"):
        rules = permissions(role, role)
        assert not [s for s in rules.publish + rules.subscribe if ".transfer." in s], role
    store = permissions("cache_store", "s", scope="store-1")
    assert "tandem.transfer.store-1.connect" in store.subscribe


async def test_the_master_elects_itself_in_its_bucket_and_no_other_role_writes_the_key(
    secured, master
):
    """The master identity creates, reads and writes the leader bucket (it leads); it may
    not delete that stream nor write another bucket, and a worker may not write the key."""
    assert master.role == "leader" and master.epoch > 0
    claimed = master.election.revision
    bucket = election_bucket("tandem")
    nc, decode = await secured.connect("master"), await secured.connect("decode")
    await nc.publish(f"$JS.API.STREAM.DELETE.KV_{bucket}", b"")
    await nc.publish("$KV.OTHER.leader", b"x")
    await decode.publish(f"$KV.{bucket}.leader", b"x")
    await nc.flush()
    await decode.flush()
    assert await secured.wait_refused("master", "publish", f"$JS.API.STREAM.DELETE.KV_{bucket}")
    assert await secured.wait_refused("master", "publish", "$KV.OTHER.leader")
    assert await secured.wait_refused("decode", "publish", f"$KV.{bucket}.leader")
    await asyncio.sleep(1.0)  # more than a renewal period
    assert master.role == "leader" and master.election.revision > claimed  # renewed


async def test_the_router_pins_and_the_master_saves_the_pin_where_no_worker_may_pin(
    secured, master
):
    """Soft pins (services/cache_master/pins/endpoints.py): the router identity calls pin and
    pins; the master identity may write the pin into its bucket (a refused write would
    answer 503); a worker or the cli may not pin."""
    router = await secured.connect("router")
    reply = await router.request("tandem.pool.master.pin", PoolPin(["0" * 32], 60.0).encode(),
                                 timeout=5)  # fmt: skip
    info = PoolPinInfo.decode(reply.data)  # a 503 (not saved) would not decode
    reply = await router.request("tandem.pool.master.pins", PoolPinList().encode(), timeout=5)
    assert [p.pin_id for p in PoolPinList.decode(reply.data).pins] == [info.pin_id]
    assert (await master.pinning.store.load(0.0))[0].pin_id == info.pin_id
    for name in ("decode", "cli"):
        nc = await secured.connect(name)
        with pytest.raises(nats.errors.TimeoutError):
            await nc.request("tandem.pool.master.pin", PoolPin(["1" * 32], 60.0).encode(),
                             timeout=0.5)  # fmt: skip
        assert await secured.wait_refused(name, "publish", "tandem.pool.master.pin"), name
    assert not secured.errors["router"]


async def test_the_router_keeps_stored_responses_in_its_bucket_where_no_worker_writes(secured):
    """Stored responses (services/router/requests/stored.py) under the router identity: the
    router creates the bucket, writes, reads and deletes a response; a worker may not write
    into it, and the router may not delete the bucket's stream."""
    bus = Bus(secured.server.url, "router", 5, 5, str(secured.files["router"]))
    await bus.connect()
    try:
        store = ResponseStore(bus, RouterConfig(nats_url=secured.server.url))
        record = StoredResponse("resp_" + "a" * 32, 1.0, [{"role": "user", "content": "hi"}])
        assert await store.put(record)
        assert await store.get(record.id) == record
        assert await store.delete(record.id) and await store.get(record.id) is None
    finally:
        await bus.close()
    bucket = responses_bucket("tandem")
    router, decode = await secured.connect("router"), await secured.connect("decode")
    await decode.publish(f"$KV.{bucket}.resp_x", b"x")
    await router.publish(f"$JS.API.STREAM.DELETE.KV_{bucket}", b"")
    await decode.flush()
    await router.flush()
    assert await secured.wait_refused("decode", "publish", f"$KV.{bucket}.resp_x")
    assert await secured.wait_refused("router", "publish", f"$JS.API.STREAM.DELETE.KV_{bucket}")
