"""Which workers run a request: the worker table, the KV index and its feed, the cost
formulas (policy.py) and the RouteSelector. Pure Python; imports no other room of the
router (only libs/ and metrics.py)."""
