"""Two network namespaces joined by a veth pair, for link-cut tests (needs root).

    root namespace                   ns <tag>-p                    ns <tag>-d
    nats-server 127.0.0.1:N  <--relay--  127.0.0.1:N                 127.0.0.1:N  (relay)
    router, the test                     prefill  10.200.0.1/30 ==veth== 10.200.0.2/30  decode

Only the KV transfer crosses the veth: each namespace reaches the root namespace's
nats-server through a relay whose listening socket lives inside that namespace (created
by a thread that entered it with setns) and whose upstream socket lives in the root
namespace. So cutting the veth cuts exactly the prefill <-> decode link, as a failed
cable or switch port would, while the control plane stays up.

Nothing of the host's own network is touched: the addresses exist only inside the two
namespaces, and deleting the namespaces (always, in `close`) removes the veth with them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import socket
import subprocess
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
P_ADDR, D_ADDR = "10.200.0.1", "10.200.0.2"


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def unavailable() -> str | None:
    """Why namespaces cannot be used here (a skip reason), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"tdm-probe-{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", name)
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        return f"cannot create a network namespace: {e}"
    with contextlib.suppress(Exception):
        _ip("netns", "del", name)
    return None


def in_netns(name: str, make: Callable[[], T]) -> T:
    """Run `make` in a thread that entered namespace `name`: sockets it creates live there
    (a socket keeps the namespace it was created in; the calling thread is untouched)."""
    out: list = []

    def enter() -> None:
        try:
            fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {name}")
            finally:
                os.close(fd)
            out.append(make())
        except BaseException as e:  # handed to the caller
            out.append(e)

    thread = threading.Thread(target=enter, name=f"netns-{name}")
    thread.start()
    thread.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def drop_unavailable() -> str | None:
    """Why `cut(mode="drop")` cannot be used here, or None when it can."""
    return None if shutil.which("nft") else "nft (nftables) is not installed"


class Relay:
    """<host>:<port> inside namespace `netns` -> `target` in the root namespace."""

    def __init__(self, netns: str, port: int, target: tuple[str, int], host: str = "127.0.0.1"):
        self.netns, self.port, self.target, self.host = netns, port, target, host
        self._listener: socket.socket | None = None
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> Relay:
        self._listener = in_netns(
            self.netns, lambda: socket.create_server((self.host, self.port), backlog=64)
        )
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()
        return self

    def _accept(self) -> None:
        while True:
            try:
                inner, _ = self._listener.accept()
            except OSError:
                return
            try:
                outer = socket.create_connection(self.target, timeout=5)
                outer.settimeout(None)
            except OSError:
                inner.close()
                continue
            with self._lock:
                self._socks += [inner, outer]
            for a, b in ((inner, outer), (outer, inner)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def stop(self) -> None:
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


class LinkedNamespaces:
    """Namespaces `<tag>-p` and `<tag>-d`, veth `<tag>p` <-> `<tag>d` (10.200.0.1/.2/30)."""

    def __init__(self, tag: str | None = None):
        tag = tag or f"tdm{os.getpid() % 100000}"
        self.p, self.d = f"{tag}-p", f"{tag}-d"
        self.veth = {self.p: f"{tag}p"[:15], self.d: f"{tag}d"[:15]}
        self.relays: list[Relay] = []
        self.cut_active = ""  # "", "route" or "drop": how the link is cut now
        self.slowed = False

    def create(self) -> LinkedNamespaces:
        _ip("netns", "add", self.p)
        _ip("netns", "add", self.d)
        vp, vd = self.veth[self.p], self.veth[self.d]
        _ip("link", "add", vp, "netns", self.p, "type", "veth", "peer", "name", vd,
            "netns", self.d)  # fmt: skip
        for ns, dev, addr in ((self.p, vp, P_ADDR), (self.d, vd, D_ADDR)):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        return self

    def relay_nats(self, port: int) -> None:
        """Make 127.0.0.1:<port> in both namespaces reach the root namespace's port."""
        for ns in (self.p, self.d):
            self.relays.append(Relay(ns, port, ("127.0.0.1", port)).start())

    def relay_nats_across(self, port: int) -> str:
        """A relay on P_ADDR:<port> in `p` to the root namespace's port: `d` reaches the bus
        through it, across the veth, so a cut silences `d`'s bus traffic too (a host that
        vanishes from the network). Returns the URL for processes in `d`."""
        self.relays.append(Relay(self.p, port, ("127.0.0.1", port), host=P_ADDR).start())
        return f"nats://{P_ADDR}:{port}"

    def command(self, ns: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, *argv]

    def tx_bytes(self, ns: str) -> int:
        """Bytes sent on the namespace's veth (the KV transfer's progress)."""
        path = f"/sys/class/net/{self.veth[ns]}/statistics/tx_bytes"
        out = subprocess.run(self.command(ns, ["cat", path]), capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"cannot read {path} in {ns}: {out.stderr.strip()}")
        return int(out.stdout)

    def _blackhole(self, action: str) -> None:
        # Each side's route to the other becomes a blackhole: the kernel drops what would
        # cross the veth at the route lookup, with no ICMP and no RST, so nothing crosses
        # either way. (iptables DROP rules do the same, but iptables is not on every host.)
        for ns, peer in ((self.p, D_ADDR), (self.d, P_ADDR)):
            _ip("-n", ns, "route", action, "blackhole", f"{peer}/32")

    def _drop(self, add: bool) -> None:
        # Each side drops at its input hook what arrives from the other (nftables, a table
        # of our own in each namespace): the sender's packets leave and vanish, so even a
        # new connect() gets no answer and waits for its own timeout.
        for ns, peer in ((self.p, D_ADDR), (self.d, P_ADDR)):
            nft = ["ip", "netns", "exec", ns, "nft"]
            steps = ([["add", "table", "inet", "tdmcut"],
                      ["add", "chain", "inet", "tdmcut", "in",
                       "{ type filter hook input priority 0 ; }"],
                      ["add", "rule", "inet", "tdmcut", "in", "ip", "saddr", peer, "drop"]]
                     if add else [["delete", "table", "inet", "tdmcut"]])  # fmt: skip
            for step in steps:
                done = subprocess.run(nft + step, capture_output=True, text=True, timeout=10)
                if done.returncode:
                    raise RuntimeError(f"nft {' '.join(step)} in {ns}: {done.stderr.strip()}")

    def cut(self, mode: str = "route") -> None:
        """Drop every packet on the link, both ways, silently (no RST, no ICMP): what a
        pulled cable or a dead switch port looks like to TCP.

        mode "route": a blackhole route on each side; a local connect() to the other side
        then fails at once (EINVAL), which a real vanished host would not do. mode "drop":
        each side drops what it receives (nft); connect() times out, as over a real cut
        (needs nft: `drop_unavailable`)."""
        if mode not in ("route", "drop"):
            raise ValueError(f"mode: 'route' or 'drop', got {mode!r}")
        if mode == "route":
            self._blackhole("add")
        else:
            self._drop(True)
        self.cut_active = mode

    def slow(self, rate: str) -> None:
        """Throttle what `p` receives from `d` to `rate` (an nft limit, e.g. "4 mbytes/second";
        the excess is dropped, so TCP settles near it): a transfer from `d` then takes
        long enough for a cut to land in the middle of it. `restore` lifts it."""
        nft = ["ip", "netns", "exec", self.p, "nft"]
        for step in (["add", "table", "inet", "tdmslow"],
                     ["add", "chain", "inet", "tdmslow", "in",
                      "{ type filter hook input priority 0 ; }"],
                     ["add", "rule", "inet", "tdmslow", "in", "ip", "saddr", D_ADDR,
                      "limit", "rate", "over", *rate.split(), "drop"]):  # fmt: skip
            done = subprocess.run(nft + step, capture_output=True, text=True, timeout=10)
            if done.returncode:
                raise RuntimeError(f"nft {' '.join(step)} in {self.p}: {done.stderr.strip()}")
        self.slowed = True

    def restore(self) -> None:
        if self.slowed:
            subprocess.run(["ip", "netns", "exec", self.p, "nft", "delete", "table", "inet",
                            "tdmslow"], capture_output=True, timeout=10)  # fmt: skip
            self.slowed = False
        if self.cut_active == "route":
            self._blackhole("del")
        elif self.cut_active == "drop":
            self._drop(False)
        self.cut_active = ""

    def close(self) -> None:
        """Stop the relays and delete both namespaces (the veth goes with them)."""
        for relay in self.relays:
            relay.stop()
        self.relays.clear()
        for ns in (self.p, self.d):
            if Path(f"/run/netns/{ns}").exists():
                with contextlib.suppress(Exception):
                    _ip("netns", "del", ns)


def created_or_skip(what: str, *checks: Callable[[], str | None]):
    """A pytest fixture's body: LinkedNamespaces created (and closed after the test), or
    the test skipped with the reason (`unavailable`, then each of `checks`)."""
    reason = unavailable() or next((r for r in (check() for check in checks) if r), None)
    if reason:
        pytest.skip(f"{what}: {reason}")
    ns = LinkedNamespaces()
    try:
        yield ns.create()
    finally:
        ns.close()
