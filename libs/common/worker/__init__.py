"""What prefill and decode workers share: the worker service base (engine, load reports, KV
events, pool tier) and the handoff of KV pages from a prefill worker to a decode worker.

May import: every other package of libs.common. Never a service.
"""
