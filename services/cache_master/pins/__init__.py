"""Soft pins on the master: the pin book (policy), the pin endpoints, and the pins' copy
in the election bucket.

May import: libs/common, `services.cache_master.metadata` and (for the bucket)
`services.cache_master.ha`.
"""
