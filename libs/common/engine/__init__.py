"""The inference engine: `Engine` (asyncio face) over `EngineCore` (the step loop).

Layers, each a package, lowest first:
  load/   where weights and text come from: loaders, model config, tokenizer, detokenizer
  core/   torch-free policy: scheduler, sequences, page table, allocator, radix cache,
          page keys, sampling parameters, stop rules, outputs
  model/  tensors: the model, its layers, attention backends, KV buffer, sampler, runner
The modules here (engine, step_loop, config, cache_io, __main__) compose them.

May import: libs.common.log, libs.common.grammar (grammar matchers) and its own packages.
Never the bus, transfer or a service.
"""
