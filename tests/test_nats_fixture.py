"""The test fixture's nats-server is real: JetStream on, reachable on its own port."""

import nats


async def test_fixture_server_accepts_connections_and_has_jetstream(nats_url):
    nc = await nats.connect(nats_url)
    try:
        info = await nc.jetstream().account_info()
        assert info.limits is not None
        sub = await nc.subscribe("t.echo")
        await nc.publish("t.echo", b"hello")
        msg = await sub.next_msg(timeout=2)
        assert msg.data == b"hello"
    finally:
        await nc.close()
