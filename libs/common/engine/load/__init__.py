"""Where weights and text come from.

Owns the model source (a GGUF file or a Hugging Face folder), the GGUF and HF loaders, the
model config, the tokenizer with its chat template, and the incremental detokenizer.
The tokenizer and model metadata load without torch (the router uses them); the weight
loaders import torch only when called.

May import: the standard library, numpy, gguf, tokenizers, jinja2; torch in the weight
loaders only. Never engine.core, engine.model, the bus or a service.
"""
