"""The rdma transport's queue-pair exchange over NATS: how a service wires rdma.

    tandem.transfer.<engine-id>.connect    request and reply: RdmaConnect

Each service that owns a transfer engine (workers, cache stores) builds it with
`engine_options` (the engine id is the service id, so a region descriptor's `endpoint`
names the subject to ask) and, once it runs, calls `serve_connect`: a micro service
`tandem-transfer` whose endpoint lets the engine check the region id and token before it
creates queue pairs. tcp and shm need neither (their descriptors carry an address or a
shared-memory name): for them both do nothing.
"""

from __future__ import annotations

from typing import Any

from libs.common import __version__
from libs.common.bus.connection import Bus, Endpoint, HandlerError
from libs.common.messages.control import RdmaConnect
from libs.common.transfer import TransferEngine
from libs.common.transfer.rdma.engine import RdmaTransferEngine

CONNECT_TIMEOUT_S = 10.0


def connect_subject(prefix: str, engine_id: str) -> str:
    return f"{prefix}.transfer.{engine_id}.connect"


def engine_options(transport: str, bus: Bus, prefix: str, service_id: str) -> dict[str, Any]:
    """Extra `create_engine` options for `transport` (rdma: the exchange over `bus`)."""
    if transport != "rdma":
        return {}

    async def connect_peer(endpoint: str, request: dict[str, Any]) -> dict[str, Any]:
        reply = await bus.request(connect_subject(prefix, endpoint), RdmaConnect(request),
                                  RdmaConnect, timeout=CONNECT_TIMEOUT_S)  # fmt: skip
        return reply.exchange

    return {"connect_peer": connect_peer, "engine_id": service_id}


def connect_endpoints(engine: TransferEngine, prefix: str) -> list[Endpoint]:
    """The endpoint peers dial to set up queue pairs with `engine` (none unless rdma)."""
    if not isinstance(engine, RdmaTransferEngine):
        return []

    async def accept(request: RdmaConnect) -> RdmaConnect:
        try:
            return RdmaConnect(await engine.accept_peer(request.exchange))
        except ValueError as e:  # a malformed exchange, or an unknown region / bad token
            raise HandlerError(403 if "token" in str(e) else 400, str(e)) from None

    subject = connect_subject(prefix, engine.endpoint)
    return [Endpoint("transfer_connect", subject, RdmaConnect, accept, concurrent=True)]


async def serve_connect(bus: Bus, engine: TransferEngine, prefix: str, service_id: str) -> None:
    """Serve `engine`'s queue-pair exchange on `bus` (nothing unless rdma)."""
    endpoints = connect_endpoints(engine, prefix)
    if endpoints:
        await bus.add_service(name="tandem-transfer", version=__version__,
                              description="rdma queue-pair exchange", endpoints=endpoints,
                              metadata={"service_id": service_id})  # fmt: skip
