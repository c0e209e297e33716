"""The worker: one core, one module per role, composed by one service.

    service.py          WorkerService: the core and its roles, by role name ("prefill",
                        "decode", or "both": the two roles on one core)
    core.py             WorkerCore: engine, transfer engine, KV pool tier, KV events; it
                        publishes the load reports and subscribes to cancels and routers'
                        heartbeats
    held.py             the requests the worker holds: cancels, early ones remembered,
                        and cancel on their router's silence
    load.py             the counts and latency windows (latency.py) a load report says
    decode.py           the decode role: admission, local or handed-over prefill, generation
    backlog.py          the decode role's admission by expected prefill wait
    token_publisher.py  a request's tokens to its router (TokenChunk, or one batch per step)
    phases.py           a request's engine phases as spans of its trace (queue, prefill
                        chunks, decode), for both roles
    prefill.py          the prefill role: compute a prompt, hand its KV to a decode worker
    handoff/            both halves of the KV handoff (sender.py, receiver.py) and what they
                        share (protocol.py)
    router_watch.py     which routers are alive; requests keyed by router
    wire.py             the bus's formats <-> the engine's: sampling in, logprobs out

services/prefill and services/decode are the entry points that build a WorkerService.
Calls go down only: service -> roles -> handoff -> core; the core calls no role.

May import: every other package of libs.common. Never a service.
"""
