"""Grammar work in worker processes, each job answered within a deadline.

    pool = GrammarPool(tokenizer_json, vocab_size, eos_token_ids, workers=2, deadline=2.0)
    pool.start()                                   # blocking: spawns the workers
    text = await pool.run(key, fn, param, *args)   # fn(compiler, param, *args) in a worker
    pool.close()

Why processes: converting an EBNF grammar (llguidance's GBNF converter is pure Python)
holds the GIL, so a thread would still stall the event loop, and no thread can be stopped.
A job past the deadline is a GrammarError "too complex" naming `param`; its worker is
killed and a new one started, so the jobs after it find a live worker. The deadline runs
from the moment a worker takes the job: waiting for a free worker does not count.

Answers (a text, None, or the GrammarError, a timeout included) are kept in an LRU keyed by
`key` (the caller's hash of the job, `GrammarPool.key`), so the same grammar costs a worker
once; runs of the same key at the same time share one job. `fn` is a module-level function
(sent by name) taking the worker's GrammarCompiler, so a job can compile what it built;
its arguments are strings. The pool itself knows nothing of requests or of the API.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import multiprocessing
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from libs.common.grammar.build import GrammarError
from libs.common.grammar.compiler import GrammarCompiler
from libs.common.log import get_logger

log = get_logger(__name__)

Job = Callable[..., str | None]  # fn(compiler, param, *args): a text, None, or GrammarError
Reply = tuple[Any, ...]  # ("ok", value) | ("err", param, message) | ("timeout",) | ("crash",)
_START_S = 120.0  # a worker's start: a new interpreter, llguidance, the tokenizer


class GrammarPool:
    """`workers` processes, each with a GrammarCompiler for one tokenizer; an LRU of
    `max_entries` answers. Use run() from one event loop."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        workers: int = 2,
        deadline: float = 2.0,
        max_entries: int = 256,
    ) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a threaded process
        init = (tokenizer_json, vocab_size, tuple(eos_token_ids))
        self._workers = [_Worker(context, init) for _ in range(workers)]
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        for worker in self._workers:
            self._idle.put_nowait(worker)
        self.deadline = deadline
        self.max_entries = max_entries
        self._cache: collections.OrderedDict[str, Reply] = collections.OrderedDict()
        self._inflight: dict[str, asyncio.Future[Reply]] = {}
        self._restarts: set[asyncio.Future[None]] = set()
        self.jobs = 0  # jobs a worker ran (cache misses)
        self.timeouts = 0  # jobs stopped at the deadline

    @staticmethod
    def key(fn: Job, *args: str) -> str:
        """The cache key of a job: a hash of the function's name and its arguments (the
        param is left out: the same grammar asked by two fields is one job)."""
        digest = hashlib.sha256(f"{fn.__module__}.{fn.__qualname__}".encode())
        for arg in args:
            digest.update(b"\0%d\0" % len(arg))
            digest.update(arg.encode("utf-8", "surrogatepass"))
        return digest.hexdigest()

    def start(self) -> None:
        """Start every worker (blocking: run it off the event loop)."""
        for worker in self._workers:
            worker.start()

    def close(self) -> None:
        """Stop every worker; safe twice and on a pool never started."""
        for worker in self._workers:
            worker.stop()

    async def run(self, key: str, fn: Job, param: str, *args: str) -> str | None:
        """fn(compiler, param, *args) in a worker, or its cached answer; GrammarError
        (naming `param`) for a grammar it refuses or one past the deadline."""
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
        else:
            job = self._inflight.get(key)
            if job is None:  # a task of its own: a client that leaves does not stop it
                job = asyncio.ensure_future(self._job(key, fn, param, args))
                self._inflight[key] = job
            hit = await asyncio.shield(job)
        return self._answer(hit, param)

    async def _job(self, key: str, fn: Job, param: str, args: tuple[str, ...]) -> Reply:
        try:
            worker = await self._idle.get()
            try:
                reply = await asyncio.to_thread(worker.call, fn, param, args, self.deadline)
            except BaseException:
                self._idle.put_nowait(worker)
                raise
            self.jobs += 1
            if reply[0] in ("timeout", "crash"):
                self.timeouts += reply[0] == "timeout"
                log.warning("grammar worker replaced", reason=reply[0], param=param)
                restart = asyncio.ensure_future(self._restart(worker))
                self._restarts.add(restart)
                restart.add_done_callback(self._restarts.discard)
            else:
                self._idle.put_nowait(worker)
            self._cache[key] = reply
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
            return reply
        finally:
            del self._inflight[key]

    async def _restart(self, worker: _Worker) -> None:
        """A new process for a killed worker, then back to work (a failed start is tried
        again by the worker's next job)."""
        try:
            await asyncio.to_thread(worker.start)
        except Exception as e:
            log.error("grammar worker did not start", error=str(e))
        finally:
            self._idle.put_nowait(worker)

    def _answer(self, reply: Reply, param: str) -> str | None:
        if reply[0] == "ok":
            value: str | None = reply[1]
            return value
        if reply[0] == "err":
            raise GrammarError(reply[1], reply[2])
        if reply[0] == "timeout":
            raise GrammarError(
                param,
                f"'{param}': grammar too complex (checking it took longer than "
                f"{self.deadline:g} s)",
            )
        raise GrammarError(param, f"'{param}': the grammar could not be checked")


class _Worker:
    """One worker process and the pipe to it; call() and start() block."""

    def __init__(self, context: Any, init: tuple[str, int, tuple[int, ...]]) -> None:
        self._context = context
        self._init = init
        self._process: Any = None
        self._conn: Connection | None = None

    def start(self) -> None:
        self.stop()
        parent, child = self._context.Pipe()
        process = self._context.Process(
            target=_serve, args=(child, *self._init), name="grammar-worker", daemon=True
        )
        process.start()
        child.close()
        self._process, self._conn = process, parent
        if not parent.poll(_START_S) or parent.recv() != "ready":
            self.stop()
            raise RuntimeError("a grammar worker did not start")

    def call(self, fn: Job, param: str, args: tuple[str, ...], deadline: float) -> Reply:
        if self._conn is None:
            self.start()
        conn = self._conn
        if conn is None:  # start() sets it or raises
            return ("crash",)
        try:
            conn.send((fn, param, args))
            if conn.poll(deadline):
                reply: Reply = conn.recv()
                return reply
        except (EOFError, OSError):  # the process died under the job
            self.stop()
            return ("crash",)
        self.stop()
        return ("timeout",)

    def stop(self) -> None:
        process, self._process = self._process, None
        conn, self._conn = self._conn, None
        if process is not None:
            process.kill()
            process.join(5.0)
            if process.exitcode is not None:
                process.close()
        if conn is not None:
            conn.close()


def _serve(conn: Connection, tokenizer_json: str, vocab_size: int, eos: tuple[int, ...]) -> None:
    """A worker's life: build the compiler, then answer jobs until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the router's Ctrl-C is the router's
    compiler = GrammarCompiler(tokenizer_json, vocab_size, eos)
    conn.send("ready")
    while True:
        try:
            fn, param, args = conn.recv()
        except EOFError:  # the router closed the pipe or is gone
            return
        try:
            reply: Reply = ("ok", fn(compiler, param, *args))
        except GrammarError as e:
            reply = ("err", e.param, str(e))
        except Exception as e:  # a bug in a job: refused, and the worker keeps serving
            reply = ("err", param, f"'{param}': the grammar could not be checked ({e})")
        conn.send(reply)
