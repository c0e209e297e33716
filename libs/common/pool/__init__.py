"""The KV pool as workers see it: the client of cache_master and the stores, and the L3 tier
that moves an engine's pages to and from the pool.

May import: bus, messages, transfer, log; `tier` also the engine. Never a service.
"""
