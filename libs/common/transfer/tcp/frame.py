"""Wire format of the TCP transport. Fixed-size little-endian headers, no parsing of
anything variable except the ERR reason (bounded, UTF-8 text, only ever logged).

Request, client -> server, 64 bytes, then `length` payload bytes for WRITE:

     0       4     5      6       8          12      16          24           32
     +-------+-----+------+-------+----------+-------+-----------+------------+
     | magic | ver | kind | flags | op_index | 0     | batch_id  | region_id  |
     +-------+-----+------+-------+----------+-------+-----------+------------+
    32            40            48                                64
     +-------------+-------------+--------------------------------+
     | offset      | length      | token (16 bytes)               |
     +-------------+-------------+--------------------------------+

    kind   WRITE (payload follows) or READ (server answers DATA)
    flags  LAST: the last op of this batch on this connection; the server answers
           ACK once every op before it has been applied (one ack per batch per
           connection, requests are pipelined: no per-op round trip)
    op_index  index of the caller's op, echoed in ERR so errors name the op

Response, server -> client, 32 bytes, then `length` bytes for DATA and ERR:

     0       4     5      6       8          12      16          24          32
     +-------+-----+------+-------+----------+-------+-----------+-----------+
     | magic | ver | kind | 0     | op_index | 0     | batch_id  | length    |
     +-------+-----+------+-------+----------+-------+-----------+-----------+

    ACK   the batch's ops on this connection all landed (length 0)
    DATA  payload of one READ slice, in request order
    ERR   the first refused op of the batch; the server applies no later op of that
          batch on this connection (WRITE payloads are drained) and sends no ACK

A header with a bad magic, version or kind, or a length above MAX_FRAME_BYTES, makes
the server close the connection: the stream can no longer be trusted to be in sync.
"""

from __future__ import annotations

import socket
import struct

MAGIC = 0x544E_444D  # "MDNT" little-endian: Tandem
VERSION = 1

KIND_WRITE = 1
KIND_READ = 2
KIND_ACK = 3
KIND_DATA = 4
KIND_ERR = 5

FLAG_LAST = 0x1

REQUEST = struct.Struct("<IBBHII QQQQ16s")
RESPONSE = struct.Struct("<IBBHII QQ")

# One slice on the wire is at most this long; larger lengths are hostile or corrupt.
MAX_FRAME_BYTES = 1 << 30
MAX_ERROR_BYTES = 512
# Linux IOV_MAX: sendmsg takes at most this many buffers per call.
IOV_MAX = 1024


def pack_request(
    kind: int,
    flags: int,
    op_index: int,
    batch_id: int,
    *,
    region_id: int,
    offset: int,
    length: int,
    token: bytes,
) -> bytes:
    return REQUEST.pack(
        MAGIC, VERSION, kind, flags, op_index, 0, batch_id, region_id, offset, length, token
    )


def pack_response(kind: int, op_index: int, batch_id: int, length: int) -> bytes:
    return RESPONSE.pack(MAGIC, VERSION, kind, 0, op_index, 0, batch_id, length)


def error_payload(reason: str) -> bytes:
    return reason.encode("utf-8", "replace")[:MAX_ERROR_BYTES]


def set_liveness(sock: socket.socket, stall_s: float) -> None:
    """Make a dead peer (a cut link, a host gone without a FIN) fail this socket within
    about `stall_s` seconds instead of the kernel's ~15 minutes of retransmissions.

    TCP_USER_TIMEOUT bounds how long sent data may stay unacknowledged (a stalled
    transfer); keepalive probes find a silent peer while nothing is in flight (a
    server waiting for the next header, a client waiting for an ACK). Both ends set
    them. Where an option is missing (not Linux), the batch timeout still applies.
    """
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = max(1, int(stall_s / 2))
    interval = max(1, int(stall_s / 6))
    for name, value in (
        ("TCP_USER_TIMEOUT", int(stall_s * 1000)),
        ("TCP_KEEPIDLE", idle),
        ("TCP_KEEPINTVL", interval),
        ("TCP_KEEPCNT", 3),
    ):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)
