"""High availability of the pool: the masters' leader election, epochs that fence a stale
master, and repair (re-replication) after a store is lost.

May import: libs/common and `services.cache_master.metadata`.
"""
