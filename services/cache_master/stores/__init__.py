"""The master's dealings with the stores: mounts in chunks, the stores' grants for
clients, and the announcements of changes (index updates to stores, KV events).

May import: libs/common and `services.cache_master.metadata`.
"""
