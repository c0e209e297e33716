"""The pool's metadata and allocation: segments, objects, the allocator, LRU eviction,
mounts in chunks, the stores' grants for clients, and the announcements of changes.

May import: libs/common, and within the master only `metadata` itself (the other
packages build on it, never the reverse).
"""
