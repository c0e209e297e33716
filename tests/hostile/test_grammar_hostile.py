"""The worst grammars and tools a client can send, through the hostile cluster's router
(real workers, the default model): each is refused with a 400 naming its field and the
limit, or served correctly, while a /health poll every 15 ms never waits over 100 ms (the
conversion and compilation run in the grammar pool's processes, never on the loop)."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.hostile.conftest import Hostile
from tests.router.test_grammar_pool import chain

POLL_EVERY_S, STALL_S = 0.015, 0.100
KIB = 1024


@pytest.fixture(scope="module")
def router(hostile: Hostile) -> tuple[int, dict[str, str]]:
    """The hostile router's port and the headers its API key needs."""
    port = urlsplit(hostile.url).port
    assert port is not None
    return port, hostile.headers


class HealthPoller(threading.Thread):
    """GET /health every POLL_EVERY_S on one kept-alive connection, each wait recorded;
    at most 60 s and 10,000 polls."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port, self.waits = port, list[float]()
        self.done = threading.Event()

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        until = time.monotonic() + 60
        while not self.done.is_set() and time.monotonic() < until and len(self.waits) < 10_000:
            started = time.perf_counter()
            conn.request("GET", "/health")
            conn.getresponse().read()
            self.waits.append(time.perf_counter() - started)
            self.done.wait(POLL_EVERY_S)  # the pace of the polls, not a synchronisation
        conn.close()


def post(port: int, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json", **headers})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def completion(**fields: Any) -> tuple[str, bytes]:
    body = {"model": "default", "prompt": "Answer:", "max_tokens": 6, "temperature": 0,
            **fields}  # fmt: skip
    return "/v1/completions", json.dumps(body).encode()


def chat(**fields: Any) -> tuple[str, bytes]:
    body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4, "temperature": 0, **fields}  # fmt: skip
    return "/v1/chat/completions", json.dumps(body).encode()


def tools(n: int, schema: dict[str, Any], first: int = 0) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": schema}}
            for i in range(first, first + n)]  # fmt: skip


SMALL = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
BIG = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(800)}}


def text_of(out: dict[str, Any]) -> str:
    return out["choices"][0]["text"]


def refused(flag: str, param: str) -> Callable[[int, dict[str, Any]], None]:
    def check(status: int, out: dict[str, Any]) -> None:
        assert status == 400, out
        assert out["error"]["param"] == param and flag in out["error"]["message"], out

    return check


def served(ok: Callable[[dict[str, Any]], bool]) -> Callable[[int, dict[str, Any]], None]:
    def check(status: int, out: dict[str, Any]) -> None:
        assert status == 200 and ok(out), out

    return check


def served_or_too_complex(param: str, ok: Callable[[dict[str, Any]], bool]) -> Callable:
    """At a limit: served correctly, or (a slow machine) refused past --grammar-timeout."""

    def check(status: int, out: dict[str, Any]) -> None:
        if status == 400:
            assert out["error"]["param"] == param and "too complex" in out["error"]["message"]
        else:
            assert status == 200 and ok(out), out

    return check


CASES = {
    "ebnf-16KiB-of-newlines": (
        completion(ebnf="\n" * (16 * KIB) + 'root ::= "yes"\n'),
        served(lambda out: text_of(out) == "yes"),
    ),
    "ebnf-64KiB-of-newlines": (
        completion(ebnf="\n" * (64 * KIB) + 'root ::= "yes"\n'),
        refused("--grammar-max-chars", "ebnf"),
    ),
    "ebnf-512-chained-rules": (  # root and 511 more
        completion(ebnf=chain(511)),
        served_or_too_complex("ebnf", lambda out: set(text_of(out)) == {"a"}),
    ),
    "ebnf-513-rules": (completion(ebnf=chain(512)), refused("--grammar-max-rules", "ebnf")),
    "regex-catastrophic": (
        completion(regex="(x+x+)+y"),
        served(lambda out: set(text_of(out)) <= {"x", "y"} and text_of(out).startswith("x")),
    ),
    "schema-over-64KiB": (
        completion(guided_json={"type": "object", "description": "d" * (64 * KIB)}),
        refused("--grammar-max-chars", "guided_json"),
    ),
    "8000-tools": (chat(tools=tools(8000, SMALL)), refused("--max-tools", "tools")),
    "128-tools": (
        chat(tools=tools(128, SMALL), tool_choice="none"),
        served(lambda out: out["choices"][0]["message"]["role"] == "assistant"),
    ),
    "a-tool-schema-over-16KiB": (
        chat(tools=[*tools(3, SMALL), *tools(1, BIG, first=3)]),
        refused("--tool-schema-max-chars", "tools"),
    ),
}


def idle_waits(port: int, seconds: float = 0.5) -> list[float]:
    """The /health waits of the poller alone for `seconds`: the machine's own noise."""
    poller = HealthPoller(port)
    poller.start()
    poller.join(seconds)
    poller.done.set()
    poller.join(30)
    return poller.waits


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_grammar_or_tools_never_hold_the_router_loop(router, case):
    port, headers = router
    (path, body), check = CASES[case]
    # A poll may wait STALL_S more than the slowest poll with no request at all: on a quiet
    # machine that is ~STALL_S; on a loaded one the scheduler's own delays are not counted.
    noise = max(idle_waits(port))
    poller = HealthPoller(port)
    poller.start()
    try:
        status, out = post(port, path, body, headers)
    finally:
        poller.done.set()
        poller.join(30)
    check(status, out)
    assert len(poller.waits) >= 1
    assert max(poller.waits) < STALL_S + noise, (noise, sorted(poller.waits)[-5:])
