"""Engine tensors: the model and what runs it.

Owns the decoder model and its layers (linear, rope), the paged KV buffer, attention
backends behind one interface (torch, flashinfer, triton; imported lazily by name), the
sampler and the model runner that turns a scheduled batch into logits and tokens.

May import: torch, engine.core, engine.load. Never the bus, transfer or a service.
"""
