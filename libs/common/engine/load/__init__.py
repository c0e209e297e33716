"""Where weights and text come from.

Owns the model source (a GGUF file or a Hugging Face folder), the GGUF and HF loaders, the
model config, the model's own sampling defaults, the tokenizer with its chat template, and
the incremental detokenizer.
The tokenizer and model metadata load without torch (the router uses them); the weight
loaders import torch only when called.

May import: the standard library, numpy, gguf, tokenizers, jinja2; torch in the weight
loaders only; of engine.core, sampling_params alone (the bounds a model's sampling defaults
are checked against; standard library only). Never engine.model, the bus or a service.
"""
