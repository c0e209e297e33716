"""The router: the OpenAI-compatible HTTP API and KV-aware routing.

Rooms: api/ (the HTTP surface and its formats), requests/ (one request's life: prompts,
dispatch, token streams, migration), routing/ (which workers), structured/ (grammars and
tool calls). Beside them, shared by all: config.py, state.py, errors.py, metrics.py,
service.py (start and stop). A room imports libs/ and the shared modules; services/router/README.md
says which room may import which.
"""
