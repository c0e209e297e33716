"""The router: the OpenAI-compatible HTTP API and KV-aware routing.

Rooms, lowest first (a room imports only rooms before it): routing/ (which workers),
structured/ (grammars and tool calls), dispatch/ (a request on the workers: chunks, token
subscriptions, migration, heartbeat), formats/ (request and response shapes: OpenAI now),
admission/ (may a request start now), requests/ (one request's life, top to bottom), api/
(routes and handlers). Shared by all: config.py, errors.py, metrics.py, defaults.py
(sampling defaults), and state.py (the parts, built by service.py), which stands above
routing/ and dispatch/ and below the rest. Each package's docstring says what it may import.
"""
