"""What prefill and decode workers share: the worker service base (engine, load reports, KV
events, pool tier), the handoff of KV pages from a prefill worker to a decode worker, and
the prefill worker itself (`prefill.py`, writing pages through `handoff/sender.py`), which
services/prefill runs alone and the decode service's `both` role runs beside decode.

May import: every other package of libs.common. Never a service.
"""
