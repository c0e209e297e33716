"""Engine policy without torch: unit-tested alone, imported by the router too.

Owns the scheduler, sequences and their states, the per-sequence page table (kv_pages), the
page allocator, the radix prefix cache, page keys (kv_hash), sampling parameters with their
bounds, stop rules and the outputs handed back per step.

May import: the standard library, xxhash, and engine.load's tokenizer and detokenizer
(torch-free). Never torch or engine.model.
"""
