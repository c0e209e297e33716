"""Constrained decoding: what a request asks for -> a grammar -> token masks.

  build.py     request fields (a JSON schema, json_object, a regex, an EBNF grammar, tool
               calls) -> one grammar text in llguidance's format; GrammarError names the
               field. Pure functions, no tokenizer.
  compiler.py  a grammar text checked and compiled against a tokenizer once per distinct
               text (a cache keyed by its hash), off the event loop; a matcher per request.
  pool.py      the router's grammar pool: build + compile in worker processes (worker.py,
               spoken to in JSON frames), each job within a deadline, answers cached.

The grammar engine is llguidance (docs/structured_output.md says why). The router uses
the pool to refuse a bad grammar with a 400 before any worker is asked; the engine
uses compiler.py for its matchers. Torch is never imported here.

May import: llguidance, the standard library and libs.common.log. Nothing else of Tandem.
"""
