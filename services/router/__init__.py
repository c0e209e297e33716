"""The router: the OpenAI-compatible HTTP API and KV-aware routing.

Rooms: api/ (the HTTP surface and its formats), admission/ (may a request start now),
requests/ (one request's life: prompts, dispatch, token streams, migration), routing/
(which workers), structured/ (grammars and tool calls). Beside them, shared by all:
config.py, state.py (the parts, built by service.py), errors.py, metrics.py. routing/ and
structured/ import no other room; each package's docstring says what it may import.
"""
