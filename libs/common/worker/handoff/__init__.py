"""The KV handoff: a prefill worker writes a prompt's KV into a decode worker's pages.

Both halves side by side; the wire types (PrefillRequest, PrefillResult, RequestStatus)
are in libs/common/messages/control.py, the subjects in docs/protocol.md.

    decode worker (receiver.py)                  prefill worker (sender.py)
    reserve pages for the prompt (the engine)
    grant a write capability on those pages
      only, for this handoff only
    PrefillRequest: pages, capability,      ->   check_pairing: 409 on another model id,
      model id, page size, KV dtype                page size or KV dtype
                                                 compute chunk by chunk; KvSender writes
                                                   each chunk's final pages meanwhile
    watch the prefill worker (its load           token 0 to the router's stream at once
      reports, `status` probes) meanwhile        finish the writes; vouch: MAC the bytes
                                            <-   PrefillResult: check value, kv_mac
    revoke the capability (the fence: no
      late write lands after it)
    check value, then (with a KV secret)
      the MAC over the bytes that landed
    decode on from token 1

protocol.py holds what both sides compute the same way: where a page's bytes sit in a
pool (KvLayout, byte ranges, copy ops), the check value, and the claim and its MAC.

May import: libs.common (transfer, messages, engine, pool), libs.common.worker.core and
router_watch. Never a role module (decode.py, prefill.py), never a service.
"""
