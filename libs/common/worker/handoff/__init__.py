"""The KV handoff from a prefill worker to a decode worker: both halves and what they share.

May import: libs.common (transfer, messages, engine, pool). Never a service.
"""
