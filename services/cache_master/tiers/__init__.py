"""The master's side of the stores' SSD tiers: what they hold (the index and the spill
and promotion choices) and the orders sent to the stores.

May import: libs/common and `services.cache_master.metadata`.
"""
