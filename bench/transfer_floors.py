"""Floors of bench.transfer: what bare Python sockets do on this machine, same run.

No transport over Python TCP sockets can beat these, so they show whether a tcp goal
is reachable here at all:

  floor-pingpong       4 KiB sendall, 1-byte ack, both ends blocking sockets (every
                       round trip pays two scheduler wake-ups)
  floor-pingpong-poll  the same, both ends busy-polling non-blocking recvs (no sleep
                       in the kernel; what the tcp engine's bounded busy-poll aims at)
  floor-stream-Nconn   1 MiB messages sendall -> recv_into a fixed buffer over N
                       connections (N threads each end), one 1-byte ack per message
                       read back at the end of a batch: the throughput ceiling

The sink runs in a separate process, like the engine's peer.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

KIB, MIB = 1 << 10, 1 << 20


def _recv_exact(sock: socket.socket, view: memoryview, poll: bool) -> bool:
    got, total = 0, view.nbytes
    flags = socket.MSG_DONTWAIT if poll else 0
    while got < total:
        try:
            n = sock.recv_into(view[got:], total - got, flags)
        except BlockingIOError:
            continue  # busy-poll: the floor process spins until the peer closes
        if n == 0:
            return False
        got += n
    return True


def _sink_conn(sock: socket.socket, size: int, poll: bool) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(bytearray(size))
    with sock:
        while _recv_exact(sock, view, poll):
            sock.sendall(b"k")


def _sink(size: int, conns: int, poll: bool, pipe: Any) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    pipe.send(listener.getsockname()[1])
    threads = []
    for _ in range(conns):
        sock, _ = listener.accept()
        thread = threading.Thread(target=_sink_conn, args=(sock, size, poll), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()


def _with_sink(size: int, conns: int, poll: bool, body: Callable[[list], list[float]]) -> list:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_sink, args=(size, conns, poll, child), daemon=True)
    proc.start()
    socks: list[socket.socket] = []
    try:
        if not parent.poll(30):
            raise RuntimeError("floor sink did not start within 30 s")
        port = parent.recv()
        for _ in range(conns):
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            socks.append(sock)
        return body(socks)
    finally:
        for sock in socks:
            sock.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def _timed(fn: Callable[[], None], seconds: float, max_iters: int) -> list[float]:
    for _ in range(3):
        fn()
    lat: list[float] = []
    end = time.perf_counter() + seconds
    while len(lat) < max_iters and (time.perf_counter() < end or len(lat) < 5):
        t0 = time.perf_counter()
        fn()
        lat.append(time.perf_counter() - t0)
    return lat


def pingpong(seconds: float, max_iters: int, poll: bool) -> list[float]:
    payload = os.urandom(4 * KIB)
    ack = memoryview(bytearray(1))

    def body(socks: list[socket.socket]) -> list[float]:
        sock = socks[0]
        sock.settimeout(None)

        def once() -> None:
            sock.sendall(payload)
            if not _recv_exact(sock, ack, poll):
                raise ConnectionError("floor sink closed")

        return _timed(once, seconds, max_iters)

    return _with_sink(4 * KIB, 1, poll, body)


def stream(seconds: float, max_iters: int, conns: int, messages: int) -> list[float]:
    """Batches of `messages` x 1 MiB spread over `conns` connections."""
    payload = memoryview(bytearray(os.urandom(MIB)))

    def lane(sock: socket.socket, count: int) -> None:
        for _ in range(count):
            sock.sendall(payload)
        acks = memoryview(bytearray(count))
        if not _recv_exact(sock, acks, False):
            raise ConnectionError("floor sink closed")

    def body(socks: list[socket.socket]) -> list[float]:
        for sock in socks:
            sock.settimeout(None)
        shares = [messages // conns + (i < messages % conns) for i in range(conns)]
        if conns == 1:
            return _timed(lambda: lane(socks[0], messages), seconds, max_iters)
        with ThreadPoolExecutor(conns) as pool:

            def once() -> None:
                for f in [pool.submit(lane, s, n) for s, n in zip(socks, shares, strict=True)]:
                    f.result()

            return _timed(once, seconds, max_iters)

    return _with_sink(MIB, conns, False, body)


def run_floors(seconds: float, max_iters: int, conns: int, stats: Callable[..., dict]) -> list:
    rows = [
        stats("floor-pingpong", "write", "1 x 4 KiB", 4 * KIB, pingpong(seconds, max_iters, False)),
        stats("floor-pingpong-poll", "write", "1 x 4 KiB", 4 * KIB,
              pingpong(seconds, max_iters, True)),
        stats("floor-stream-1conn", "write", "1 x 1 MiB", MIB, stream(seconds, max_iters, 1, 1)),
        stats("floor-stream-1conn", "write", "64 x 1 MiB", 64 * MIB,
              stream(seconds, max_iters, 1, 64)),
    ]  # fmt: skip
    if conns > 1:
        name = f"floor-stream-{conns}conn"
        rows.append(stats(name, "write", "64 x 1 MiB", 64 * MIB,
                          stream(seconds, max_iters, conns, 64)))  # fmt: skip
    return rows
