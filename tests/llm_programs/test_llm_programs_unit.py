"""llm_programs without a Tandem stack: how programs compose their calls (against a
scripted router that answers from a table, in-process), bad calls, and the errors of real
sockets (a closed port, a server answering 400, a server that never answers)."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import pytest
from aiohttp import web

from llm_programs import (
    CallError,
    CallTimeout,
    ProgramInputError,
    Router,
    function,
    gen,
    select,
)


class ScriptedRouter(Router):
    """Answers completions from `outputs` (prompt -> text) and scoring requests from
    `scores` (continuation -> its logprobs), renders chats as `role: content` lines;
    records every body. A stand-in for the composition tests only: the real router is in
    test_llm_programs_stack.py."""

    def __init__(self, outputs=None, scores=None):
        super().__init__("http://127.0.0.1:9")
        self.outputs, self.scores = outputs or {}, scores or {}
        self.bodies: list[dict[str, Any]] = []

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def complete(self, call: str, body: dict[str, Any]) -> dict[str, Any]:
        self.bodies.append(body)
        await asyncio.sleep(0)
        if body.get("echo"):
            lps = self.scores[body["prompt"][body["prompt_logprobs_from"] :]]
            return {"choices": [{"text": body["prompt"], "logprobs": {"token_logprobs": lps}}]}
        return {"choices": [{"text": self.outputs.get(body["prompt"], "?")}]}

    async def render(self, call, messages, generation_prompt):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if generation_prompt else "")


def test_text_program_sends_each_call_the_text_so_far():
    @function
    async def prog(s, topic):
        s += f"Topic: {topic}\nTitle:"
        await s.gen("title", 8, stop="\n", temperature=0)
        s += "\nGood? "
        await s.select("good", ["yes", "no"])

    router = ScriptedRouter({"Topic: caches\nTitle:": " Radix"}, {"yes": [-0.5], "no": [-2.0]})
    state = prog.run(router, topic="caches")
    assert state["title"] == " Radix" and state["good"] == "yes"
    assert state.text == "Topic: caches\nTitle: Radix\nGood? yes"
    gen_body, *score_bodies = router.bodies
    assert gen_body == {
        "model": "default",
        "prompt": "Topic: caches\nTitle:",
        "max_tokens": 8,
        "stop": ["\n"],
        "temperature": 0,
    }
    prefix = "Topic: caches\nTitle: Radix\nGood? "
    assert [b["prompt"] for b in score_bodies] == [prefix + "yes", prefix + "no"]
    assert all(
        b["prompt_logprobs_from"] == len(prefix)
        and b["max_tokens"] == 0
        and b["echo"]
        and b["logprobs"] == 0
        for b in score_bodies
    )
    assert [(c.choice, c.logprob, c.tokens) for c in state.scores["good"]] == [
        ("yes", -0.5, 1),
        ("no", -2.0, 1),
    ]


def test_select_sums_token_logprobs_skips_null_and_takes_the_first_on_a_tie():
    @function
    async def prog(s):
        s += "Q"
        await s.select("a", ["x y", "z", "w"])

    router = ScriptedRouter(scores={"x y": [None, -1.0, -1.0], "z": [-2.0], "w": [-2.0]})
    state = prog.run(router)
    assert state["a"] == "x y" and state.scores["a"][0].logprob == -2.0


def test_chat_turns_continue_the_rendered_conversation():
    @function
    async def chat(s):
        s.system("Be brief.")
        s.user("Hi")
        await s.assistant("Hello", gen("greet", 4))
        s.user("Bye")
        await s.assistant(gen("bye", 4))

    first = "system: Be brief.\nuser: Hi\nassistant: Hello"
    router = ScriptedRouter({first: " there"})
    state = chat.run(router)
    assert [b["prompt"] for b in router.bodies] == [
        first,
        "system: Be brief.\nuser: Hi\nassistant: Hello there\nuser: Bye\nassistant: ",
    ]
    assert state.messages[2] == {"role": "assistant", "content": "Hello there"}
    assert state.text.endswith("assistant: ?\n")  # the whole chat, rendered at the end


def test_fork_sends_the_shared_prefix_once_first_and_join_gathers_the_branches_values():
    @function
    async def prog(s):
        s += "Idea:"
        branches = s.fork(3)
        for i, b in enumerate(branches):
            b += f" {i}"
        await asyncio.gather(*(b.gen("idea", 2) for b in branches))
        s.join(branches)

    router = ScriptedRouter({f"Idea: {i}": f"-{i}" for i in range(3)})
    state = prog.run(router)
    assert state["idea"] == ["-0", "-1", "-2"] and state.text == "Idea:"
    assert router.bodies[0] == {
        "model": "default",
        "prompt": "Idea:",
        "max_tokens": 1,
        "temperature": 0,
    }
    assert sorted(b["prompt"] for b in router.bodies[1:]) == [f"Idea: {i}" for i in range(3)]
    assert state.calls[0].call == "prog: fork(3) prefix"
    assert sorted(c.call for c in state.calls[1:]) == [f"prog[{i}]: gen('idea')" for i in range(3)]


def test_select_with_no_choices_names_the_call():
    with pytest.raises(ProgramInputError, match=r"select\('pick'\): no choices"):
        select("pick", [])


def test_a_name_set_twice_names_the_call_before_sending_it():
    @function
    async def prog(s):
        s += "a"
        await s.gen("x", 1)
        await s.gen("x", 1)

    router = ScriptedRouter()
    with pytest.raises(ProgramInputError, match=r"prog: gen\('x'\): the name 'x' is already"):
        prog.run(router)
    assert len(router.bodies) == 1


def test_a_gen_outside_an_assistant_turn_in_a_chat_is_refused():
    @function
    async def prog(s):
        s.user("Hi")
        await s.gen("x", 1)

    with pytest.raises(ProgramInputError, match=r"gen\('x'\): in a chat, calls run inside"):
        prog.run(ScriptedRouter())


def test_bad_gen_arguments_are_refused_when_written():
    with pytest.raises(ProgramInputError, match=r"gen\('x'\): max_tokens"):
        gen("x", 0)
    with pytest.raises(ProgramInputError, match="exclusive"):
        gen("x", regex="a", json_schema={"type": "string"})


def test_two_calls_on_one_state_at_once_are_refused():
    @function
    async def prog(s):
        s += "a"
        await asyncio.gather(s.gen("x", 1), s.gen("y", 1))

    with pytest.raises(ProgramInputError, match=r"gen\('y'\): this state is running"):
        prog.run(ScriptedRouter())


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_a_closed_port_raises_a_call_error_naming_the_call():
    @function
    async def prog(s):
        s += "a"
        await s.gen("answer", 1)

    with pytest.raises(CallError, match=r"prog: gen\('answer'\): connection to") as e:
        await prog.arun(f"http://127.0.0.1:{_closed_port()}")  # a URL: a default Router
    assert e.value.status is None


@pytest.fixture
async def bad_server():
    """A real HTTP server on a free port: 400 in OpenAI's error shape on completions."""

    async def refuse(request: web.Request) -> web.Response:
        error = {"message": "'regex': not a regular expression", "param": "regex"}
        return web.json_response({"error": error}, status=400)

    app = web.Application()
    app.router.add_post("/v1/completions", refuse)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_a_400_raises_a_call_error_with_the_routers_message(bad_server):
    @function
    async def prog(s):
        s += "a"
        await s.gen("code", 4, regex="(")

    with pytest.raises(CallError, match=r"gen\('code'\): the router answered 400: 'regex'") as e:
        await prog.arun(Router(bad_server))
    assert e.value.status == 400


@pytest.fixture
async def silent_server():
    """A real TCP server that reads and never answers; or, for `/stream`, answers the
    headers and one event, then stalls."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if b"stream" in head.split(b"\r\n")[0] or b'"stream"' in await _body(reader, head):
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n"
                b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'
            )
            await writer.drain()
        await asyncio.sleep(3600)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def _body(reader: asyncio.StreamReader, head: bytes) -> bytes:
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return await reader.readexactly(int(line.split(b":")[1]))
    return b""


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_router_that_never_answers_times_out_naming_the_call(silent_server, streamed):
    @function
    async def prog(s):
        s += "a"
        await s.gen("answer", 4)

    router = Router(silent_server, timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(CallTimeout, match=r"prog: gen\('answer'\): no"):
        if streamed:
            async for _ in prog.stream(router):
                pass
        else:
            await prog.arun(router)
    assert time.monotonic() - t0 < 3


async def test_a_stream_cut_before_its_end_is_an_error_not_a_short_answer():
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"connection: close\r\n\r\n"
            b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)

    @function
    async def prog(s):
        s += "a"
        await s.gen("answer", 4)

    router = Router(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", timeout=5)
    try:
        with pytest.raises(CallError, match=r"gen\('answer'\): the stream ended before"):
            async for _ in prog.stream(router):
                pass
    finally:
        server.close()


async def test_closing_a_stream_early_cancels_its_run(silent_server):
    @function
    async def prog(s):
        s += "a"
        await s.gen("answer", 4)

    run = prog.stream(Router(silent_server, timeout=30))
    t0 = time.monotonic()
    async for piece in run:
        assert piece.text == "x"
        break
    await run.aclose()
    assert time.monotonic() - t0 < 3 and run.state is None
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert [t for t in others if "silent_server" not in t.get_coro().__qualname__] == []


async def test_run_batch_bounds_concurrency():
    active = peak = 0

    class Counting(ScriptedRouter):
        async def complete(self, call, body):
            nonlocal active, peak
            active += 1
            peak = max(peak, active)
            await asyncio.sleep(0.01)
            active -= 1
            return await super().complete(call, body)

    @function
    async def prog(s, i):
        s += str(i)
        await s.gen("x", 1)

    states = await prog.arun_batch(Counting(), [{"i": i} for i in range(10)], concurrency=3)
    assert peak == 3 and [s.text for s in states] == [f"{i}?" for i in range(10)]


async def test_run_batch_returns_exceptions_in_place_when_asked():
    @function
    async def prog(s, i):
        s += "a"
        if i == 1:
            select("empty", [])

    out = await prog.arun_batch(ScriptedRouter(), [{"i": 0}, {"i": 1}], return_exceptions=True)
    assert out[0].text == "a" and isinstance(out[1], ProgramInputError)


def test_the_package_imports_nothing_of_tandem():
    """It talks to a router over HTTP only: no import of services/ or libs/."""
    from tests.test_code_shape import REPO, imported_modules

    found = [
        f"{p.name}: {name}"
        for p in (REPO / "llm_programs").rglob("*.py")
        for name in imported_modules(p)
        if name.split(".")[0] in ("services", "libs")
    ]
    assert found == []
