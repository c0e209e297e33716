"""One request's life: parse -> prompts -> choices -> dispatch -> stream or collect
(lifecycle.py), the generation on the workers (dispatch.py, subscriptions.py, chunk_order.py,
migration.py) and the heartbeat that keeps this router's requests alive on them. May
import api/ (bodies, SSE, formats), admission/, routing/, structured/ and the shared
modules."""
