"""Which workers run a request: the worker table, the KV index and its feed from the bus
(kv_feed.py), the cost formulas (policy.py) and the RouteSelector. The scoring is pure
Python, typed under mypy's strict flags (pyproject.toml). Imports no other room of the
router (only libs/ and metrics.py)."""
