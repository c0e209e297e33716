"""Unregister's hold on the TCP server's connections (region.py `enter`/`remove`)."""

from __future__ import annotations

import contextlib
import socket
import threading

from libs.common.transfer.region import Region


class OpFence:
    """Unregister's hold on one server connection: the region its op is moving bytes for
    right now, and the cut (`RegionTable.remove` calls it with the region going away).

    The cut shuts the connection down only while that same region's op is running (a
    cut from a stale list of users must not kill the connection's next op, on another
    region), and never races the socket's close (a reused descriptor number)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self._region_id = 0  # region ids are never 0

    def start(self, region_id: int) -> None:
        with self._lock:
            self._region_id = region_id

    def end(self) -> None:
        with self._lock:
            self._region_id = 0

    def __call__(self, region: Region) -> None:
        with self._lock:
            if self._region_id == region.region_id:
                with contextlib.suppress(OSError):  # recv/send in the thread return at once
                    self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            self._sock.close()
