"""The pool's metadata and allocation, pure Python: segments, objects, the offset
allocator, LRU eviction, and `PoolMetadata`, which owns them and applies the rules.

May import: the standard library only (no bus, no messages): every other package of the
master builds on this one, never the reverse.
"""
