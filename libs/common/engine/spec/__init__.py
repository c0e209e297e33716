"""Speculative decoding: draft tokens proposed cheaply, verified by the target model in one
forward pass (see docs/engine.md, "Speculative decoding").

Owns the `Proposer` interface and its implementations (n-gram lookup in the request's own
tokens; a small draft model of the target's tokenizer), the per-request draft length
policy and the acceptance rule.

May import: torch, engine.core, engine.model, engine.load (a draft model's loader). Never
the bus, transfer or a service.
"""
