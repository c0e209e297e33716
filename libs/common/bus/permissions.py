"""Who may say what on the bus: each role's publish and subscribe allow lists.

One table, rendered into nats-server's `authorization { users = [...] }` by
scripts/identities.py for `make run`, compose and Kubernetes alike. nats-server enforces
it: a publish outside the list is dropped (the client gets a permissions violation) and a
subscription outside it is refused, so a request to a subject its sender may not use
gets no reply at all.

- `scope` is the service id an identity is bound to, or `*` for every instance of the
  role. With an id, the subjects that name one instance (its load report, its KV events,
  its endpoints, its token streams) are that id's only: a worker cannot speak for another.
  `make run` binds each process's identity to its id; compose and Kubernetes give one
  identity per role (replicas share a Secret), so there a worker could still forge a
  sibling's load report, never another role's subjects.
- Replies: every identity reads replies only under its own inbox prefix
  (`inbox_prefix(user)`, which Bus passes to nats-py), so it cannot read another's
  replies (pool replies carry region descriptors, which are capabilities). Services
  answer requests through `allow_responses` (one reply to the request's reply subject),
  so no identity needs publish rights on inboxes.
- JetStream: writers of KV events may create the events stream (idempotent at start and
  after a reconnect); readers (the router, an operator) may look at it and make
  consumers on it; nobody here may delete or change a stream. Masters elect their leader
  in their own key-value bucket (`election_bucket`, services/cache_master/ha/election.py):
  they may create it, read it and write its keys, nothing else of JetStream's. Routers
  keep the Responses API's stored responses in a bucket of theirs (`responses_bucket`,
  services/router/requests/stored.py) with the same rights on it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from libs.common.bus.credentials import inbox_prefix
from libs.common.bus.kv_events import stream_name

ROLES = ("router", "prefill", "decode", "both", "cache_master", "cache_store", "planner", "cli")
# The service (`python -m services.<service>`, micro name `tandem-<service>`) of each role.
SERVICE_OF = {"both": "decode", "cli": ""} | {r: r for r in ROLES if r not in ("both", "cli")}
# The roles that own a transfer engine (peers dial them for rdma queue pairs).
TRANSFER_ROLES = ("prefill", "decode", "both", "cache_store")

# The master's endpoints (`<prefix>.pool.master.<name>`), by who may call them.
STORE_CALLS = ("mount", "mount_chunk", "mount_end", "mount_page", "unmount", "heartbeat",
               "ssd_report")  # fmt: skip
CLIENT_CALLS = ("put_start", "put_end", "put_revoke", "get", "exists", "remove", "drop", "stats")
# Soft pins (services/cache_master/pins/endpoints.py): the router's pin API asks the master.
PIN_CALLS = ("pin", "unpin", "pins")
# What the master sends one store (`<prefix>.pool.store.<id>.<name>`): index updates, copy
# orders, the transfer grants of a get or put, and SSD tier orders (spill, promote, remove).
MASTER_TO_STORE = ("update", "replicate", "grant", "ssd")


def election_bucket(prefix: str) -> str:
    """The JetStream KV bucket where the masters of subject prefix `prefix` elect their
    leader (bucket names allow letters, digits, `_` and `-`)."""
    return _bucket("TANDEM_POOL_MASTER", prefix)


def responses_bucket(prefix: str) -> str:
    """The JetStream KV bucket where the routers of subject prefix `prefix` keep stored
    responses (POST /v1/responses with `store`)."""
    return _bucket("TANDEM_RESPONSES", prefix)


def _bucket(base: str, prefix: str) -> str:
    return base if prefix == "tandem" else f"{base}_{re.sub(r'[^A-Za-z0-9]', '_', prefix).upper()}"


@dataclass(frozen=True)
class Permissions:
    """nats-server's `permissions` of one user: allow lists, and whether it may reply."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responses: bool


def permissions(role: str, user: str, prefix: str = "tandem", scope: str = "*") -> Permissions:
    """The allow lists of `user` acting as `role`, bound to service id `scope` (or `*`)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; one of {list(ROLES)}")
    p = prefix
    if role == "cli":
        publish = ["$SRV.>", f"{p}.*.*.info", f"{p}.pool.master.stats", *_js_reader(p)]
        subscribe = [f"{p}.kv.events.>", f"{p}.workers.*.*.load"]
        return Permissions(tuple(publish), (*subscribe, inbox_prefix(user) + ".>"), False)
    publish, subscribe = _ROLE_RULES[role](p, scope)
    service = SERVICE_OF[role]
    # Every service: its micro discovery and info endpoint, and the health check's asks.
    micro = [f"$SRV.{verb}" for verb in ("PING", "INFO", "STATS")]
    micro += [f"$SRV.*.tandem-{service}", f"$SRV.*.tandem-{service}.>"]
    if role in TRANSFER_ROLES:  # an rdma engine's queue-pair exchange (`tandem-transfer`)
        micro += ["$SRV.*.tandem-transfer", "$SRV.*.tandem-transfer.>"]
        subscribe.append(f"{p}.transfer.{scope}.connect")
        publish.append(f"{p}.transfer.*.connect")
    subscribe += [*micro, f"{p}.{service}.{scope}.info", inbox_prefix(user) + ".>"]
    publish += [f"$SRV.PING.tandem-{service}", f"{p}.{service}.{scope}.info"]
    return Permissions(tuple(dict.fromkeys(publish)), tuple(dict.fromkeys(subscribe)), True)


def _router(p: str, scope: str) -> tuple[list[str], list[str]]:
    publish = [f"{p}.decode.*.generate", f"{p}.cancel", f"{p}.routers.*.heartbeat"]
    publish += [*_js_writer(p), *_js_reader(p)]  # its index replays the KV events stream
    publish += _pool(p, PIN_CALLS)  # POST/GET/DELETE /v1/pins (services/router/api/pins.py)
    publish += _js_bucket(responses_bucket(p))  # stored responses (POST /v1/responses)
    subscribe = [f"{p}.workers.*.*.load", f"{p}.kv.events.>"]
    subscribe += [f"{p}.stream.{scope}.>", f"{p}.chunks.{scope}"]
    return publish, subscribe


def _worker(p: str, scope: str, load_role: str) -> tuple[list[str], list[str]]:
    """What prefill and decode workers share: load, KV events, tokens, pool, liveness."""
    publish = [f"{p}.workers.{load_role}.{scope}.load", f"{p}.kv.events.{scope}"]
    publish += [f"{p}.stream.>", *_pool(p, CLIENT_CALLS), *_js_writer(p)]
    subscribe = [f"{p}.cancel", f"{p}.routers.*.heartbeat"]
    return publish, subscribe


def _prefill(p: str, scope: str) -> tuple[list[str], list[str]]:
    publish, subscribe = _worker(p, scope, "prefill")
    subscribe += [f"{p}.prefill.{scope}.prefill", f"{p}.prefill.{scope}.status"]
    return publish, subscribe


def _decode(p: str, scope: str, load_role: str = "decode") -> tuple[list[str], list[str]]:
    publish, subscribe = _worker(p, scope, load_role)
    publish += [f"{p}.chunks.>", f"{p}.prefill.*.prefill", f"{p}.prefill.*.status"]
    subscribe += [f"{p}.decode.{scope}.generate", f"{p}.workers.*.*.load"]
    return publish, subscribe


def _both(p: str, scope: str) -> tuple[list[str], list[str]]:
    """A decode worker with `--role both`: it also serves prefill for other workers."""
    publish, subscribe = _decode(p, scope, "both")
    subscribe += [f"{p}.prefill.{scope}.prefill", f"{p}.prefill.{scope}.status"]
    return publish, subscribe


def _cache_master(p: str, scope: str) -> tuple[list[str], list[str]]:
    publish = [f"{p}.pool.store.*.{call}" for call in MASTER_TO_STORE]
    publish += [f"{p}.pool.master.epoch", f"{p}.kv.events.*", *_js_writer(p), *_js_election(p)]
    subscribe = [*_pool(p, (*STORE_CALLS, *CLIENT_CALLS, *PIN_CALLS)), f"{p}.pool.master.epoch"]
    return publish, subscribe


def _cache_store(p: str, scope: str) -> tuple[list[str], list[str]]:
    publish = _pool(p, STORE_CALLS)
    subscribe = [f"{p}.pool.store.{scope}.{call}" for call in MASTER_TO_STORE]
    return publish, subscribe


def _planner(p: str, scope: str) -> tuple[list[str], list[str]]:
    """It only listens: the workers' load reports (services/planner)."""
    return [], [f"{p}.workers.*.*.load"]


_ROLE_RULES = {
    "router": _router,
    "prefill": _prefill,
    "decode": _decode,
    "both": _both,
    "cache_master": _cache_master,
    "cache_store": _cache_store,
    "planner": _planner,
}


def _pool(p: str, calls: tuple[str, ...]) -> list[str]:
    return [f"{p}.pool.master.{name}" for name in calls]


def _js_writer(p: str) -> list[str]:
    """Make sure the KV events stream exists (libs/common/bus/kv_events.py)."""
    stream = stream_name(p)
    return ["$JS.API.INFO", f"$JS.API.STREAM.CREATE.{stream}", f"$JS.API.STREAM.INFO.{stream}"]


def _js_election(p: str) -> list[str]:
    """The masters' leader bucket: create it (idempotent), look it up, read its keys (direct
    or stream get) and write them (compare-and-set publishes on `$KV.<bucket>.<key>`)."""
    return _js_bucket(election_bucket(p))


def _js_bucket(bucket: str) -> list[str]:
    """One KV bucket: create it (idempotent), look it up, read its keys, write and delete
    them (publishes on `$KV.<bucket>.<key>`); never delete or change its stream."""
    stream, api = f"KV_{bucket}", "$JS.API"
    return [
        f"{api}.STREAM.CREATE.{stream}",
        f"{api}.STREAM.INFO.{stream}",
        f"{api}.STREAM.MSG.GET.{stream}",
        f"{api}.DIRECT.GET.{stream}.>",
        f"$KV.{bucket}.>",
    ]


def _js_reader(p: str) -> list[str]:
    """Read the KV events stream: its info, consumers on it (ordered, ephemeral), their
    flow control and acks, single messages. Nothing that changes or deletes the stream."""
    stream = stream_name(p)
    api = "$JS.API"
    return [
        f"{api}.INFO",
        f"{api}.STREAM.NAMES",
        f"{api}.STREAM.LIST",
        f"{api}.STREAM.INFO.{stream}",
        f"{api}.STREAM.MSG.GET.{stream}",
        f"{api}.DIRECT.GET.{stream}",
        f"{api}.DIRECT.GET.{stream}.>",
        f"{api}.CONSUMER.CREATE.{stream}",
        f"{api}.CONSUMER.CREATE.{stream}.>",
        f"{api}.CONSUMER.INFO.{stream}.*",
        f"{api}.CONSUMER.DELETE.{stream}.*",
        f"{api}.CONSUMER.MSG.NEXT.{stream}.*",
        f"{api}.CONSUMER.NAMES.{stream}",
        f"{api}.CONSUMER.LIST.{stream}",
        f"$JS.FC.{stream}.>",
        f"$JS.ACK.{stream}.>",
    ]
