"""The decode worker: reserves KV pages, receives prompt KV, generates and streams tokens."""
