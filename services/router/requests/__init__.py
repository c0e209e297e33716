"""One request's life in the router, read top to bottom in lifecycle.py: parse -> admit ->
prompts (prompts.py: chat template, token ids, sampling defaults) -> choices -> dispatch ->
stream or collect. May import formats/, admission/, structured/, dispatch/, routing/ and
the shared modules; never api/."""
