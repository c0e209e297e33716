"""The master's dealings with the stores: mounts in chunks and the stores' endpoints
(mount, unmount, heartbeat), the stores' grants for clients, and the announcements of
changes (index updates to stores, KV events).

May import: libs/common, `services.cache_master.metadata` and (for the fence)
`services.cache_master.ha.epoch`.
"""
