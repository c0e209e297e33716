"""A request on the workers: send GenerateRequest and hand its TokenChunks on in order
(dispatcher.py, chunk_order.py), the router's two token subscriptions (subscriptions.py),
a choice's attempts across worker deaths (migration.py), and this router's heartbeat, by
which workers tell a live router from a dead one (heartbeat.py). May import routing/ and
the shared modules below state.py (errors.py, metrics.py); never state.py or a room above it."""
