"""The router: the OpenAI-compatible HTTP API and KV-aware routing."""
