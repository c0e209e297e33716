"""The TCP transport: a transfer server in every process that registers memory, payloads
received straight into the region; several connections per peer.

May import: libs.common.transfer's base modules (engine, region, ops, descriptor, errors).
"""
