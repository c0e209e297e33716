"""Every message that crosses a process boundary over NATS, and the one decoder.

Owns the envelope (schema version, type tag), the field checks and the decode of every wire
type: control messages (generate, prefill, reserve, token streams, load reports, KV events,
service info) in `control`, the pool's messages (master RPCs, heartbeats, grants, SSD
tiers) in `pool`, a store's mount in chunks in `mounts`, soft pins of prefixes (router <->
master, and their saved form) in `pins`, the Responses API's stored responses (the router's
KV bucket) in `responses`.

May import: the standard library and msgspec only, so any process (and any tool) can read
the whole protocol without loading anything else; and the sampling fields' bounds from
engine/core/sampling_params.py (standard library only), which the wire checks too.
"""
