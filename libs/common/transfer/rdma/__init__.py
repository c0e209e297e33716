"""The RDMA transport: pyverbs RC queue pairs, one-sided WRITE/READ, and the queue-pair
exchange over NATS (`exchange`). pyverbs is imported only when this transport is chosen.

May import: libs.common.transfer's base modules; `exchange` also the bus and messages.
"""
