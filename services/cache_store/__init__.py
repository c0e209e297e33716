"""A cache store: one storage node of the KV pool, a registered memory segment."""
