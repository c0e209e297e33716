"""Speculative decoding: draft tokens proposed cheaply, verified by the target model in one
forward pass (see docs/engine.md, "Speculative decoding").

Owns the `Proposer` interface and its implementations (n-gram lookup in the request's own
tokens), the per-request draft length policy and the acceptance rule.

May import: torch, engine.core, engine.model. Never the bus, transfer or a service.
"""
