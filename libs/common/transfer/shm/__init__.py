"""The shared-memory transport: same-host regions in shared memory, one copy per op.

May import: libs.common.transfer's base modules (engine, region, ops, descriptor, errors).
"""
