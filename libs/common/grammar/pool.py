"""Grammar work in worker processes, each job answered within a deadline.

    pool = GrammarPool(tokenizer_json, vocab_size, eos_token_ids, workers=2, deadline=2.0)
    pool.start()                                  # blocking: starts the workers
    items = [("ebnf", 'root ::= "a"')]            # (kind, source): build.from_source
    texts = await pool.run(GrammarPool.key(items), "ebnf", items)
    pool.close()

Each item is built (converted to llguidance's format) and compiled against the tokenizer
in a worker process (worker.py); run() answers their texts in order, or raises the
GrammarError of the first one refused; its `index` attribute says which.

Why processes: converting an EBNF grammar (llguidance's GBNF converter is pure Python)
holds the GIL, so a thread would still stall the event loop, and no thread can be stopped.
A job past the deadline is a GrammarError "too complex" naming its param; its worker is
killed and a new one started, so the jobs after it find a live worker. The deadline runs
from the moment a worker takes the job: waiting for a free worker does not count.

Answers (texts or the GrammarError, a timeout included) are kept in an LRU keyed by a hash
of the items, so the same grammar costs a worker once; runs of the same key at the same
time share one job. At most `max_queued` distinct jobs wait or run at once (16 per worker
by default: a real grammar takes milliseconds); past it run() raises GrammarPoolBusy at
once rather than hold the request and its source. The pool knows nothing of requests or
of the API.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import os
import select
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from libs.common.grammar.build import GrammarError
from libs.common.log import get_logger

log = get_logger(__name__)

Items = Sequence[tuple[str, str]]  # (kind, source) each
Reply = list[Any]  # ["ok", texts] | ["err", index, param, message] | ["timeout"] | ["crash"]
_START_S = 120.0  # a worker's start: a new interpreter, llguidance, the tokenizer
_ROOT = str(Path(__file__).resolve().parents[3])  # where `libs` is imported from


class GrammarRefused(GrammarError):
    """A GrammarError for item `index` of a job (None: the whole job, e.g. a timeout)."""

    def __init__(self, param: str, message: str, index: int | None) -> None:
        super().__init__(param, message)
        self.index = index


class GrammarPoolBusy(Exception):
    """Too many distinct grammars are waiting for a worker: try again shortly."""


class GrammarPool:
    """`workers` processes, each with a GrammarCompiler for one tokenizer; an LRU of
    `max_entries` answers; `log` is the workers' log level and format (setup_logging's).
    Use run() from one event loop."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        *,
        workers: int = 2,
        deadline: float = 2.0,
        max_entries: int = 256,
        max_queued: int | None = None,
        log: tuple[str, str] = ("info", "auto"),
    ) -> None:
        head = json.dumps([vocab_size, list(eos_token_ids), *log]).encode()
        init = (head, tokenizer_json.encode())
        self._workers = [_Worker(init) for _ in range(workers)]
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        for worker in self._workers:
            self._idle.put_nowait(worker)
        self.deadline = deadline
        self.max_entries = max_entries
        self.max_queued = 16 * workers if max_queued is None else max_queued
        self._cache: collections.OrderedDict[str, Reply] = collections.OrderedDict()
        self._inflight: dict[str, asyncio.Future[Reply]] = {}
        self._restarts: set[asyncio.Future[None]] = set()
        self.jobs = 0  # jobs a worker ran (cache misses)
        self.timeouts = 0  # jobs stopped at the deadline

    @staticmethod
    def key(items: Items) -> str:
        """The cache key of a job's items (O(their size): not on the event loop)."""
        digest = hashlib.sha256()
        for kind, source in items:
            for part in (kind, source):
                digest.update(b"%d\0" % len(part))
                digest.update(part.encode("utf-8", "surrogatepass"))
        return digest.hexdigest()

    def start(self) -> None:
        """Start every worker, all at once (blocking: run it off the event loop)."""
        for worker in self._workers:
            worker.launch()
        for worker in self._workers:
            worker.wait_ready()

    def close(self) -> None:
        """Stop every worker; safe twice and on a pool never started."""
        for worker in self._workers:
            worker.stop()

    async def run(self, key: str, param: str, items: Items) -> list[str]:
        """Every item built and compiled in a worker, or the cached answer: their texts;
        GrammarRefused naming `param` (or the param a build names) when one is refused or
        the job is past the deadline; GrammarPoolBusy past `max_queued` jobs. `key` is
        GrammarPool.key(items); the param is part of the cache key, as refusals name it."""
        key = f"{param}\0{key}"
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
        else:
            job = self._inflight.get(key)
            if job is None:  # a task of its own: a client that leaves does not stop it
                if len(self._inflight) >= self.max_queued:
                    raise GrammarPoolBusy(f"{len(self._inflight)} grammars are being checked")
                frame = json.dumps({"param": param, "items": list(items)}).encode()
                job = asyncio.ensure_future(self._job(key, frame))
                self._inflight[key] = job
            hit = await asyncio.shield(job)
        return self._answer(hit, param)

    async def _job(self, key: str, frame: bytes) -> Reply:
        try:
            worker = await self._idle.get()
            try:
                reply = await asyncio.to_thread(worker.call, frame, self.deadline)
            except BaseException:
                self._idle.put_nowait(worker)
                raise
            self.jobs += 1
            if reply[0] in ("timeout", "crash"):
                self.timeouts += reply[0] == "timeout"
                log.warning("grammar worker replaced", reason=reply[0])
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

    def _answer(self, reply: Reply, param: str) -> list[str]:
        if reply[0] == "ok":
            texts: list[str] = reply[1]
            return texts
        if reply[0] == "err":
            raise GrammarRefused(reply[2], reply[3], reply[1])
        if reply[0] == "timeout":
            message = f"grammar too complex (checking it took longer than {self.deadline:g} s)"
            raise GrammarRefused(param, f"'{param}': {message}", None)
        raise GrammarRefused(param, f"'{param}': the grammar could not be checked", None)


class _Worker:
    """One worker process (worker.py) and its pipes; call() and start() block."""

    def __init__(self, init: tuple[bytes, bytes]) -> None:
        self._init = init
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """A new process (its imports run while the caller launches others)."""
        self.stop()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (_ROOT, env.get("PYTHONPATH"))))
        process = subprocess.Popen(
            [sys.executable, "-m", "libs.common.grammar.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            bufsize=0,
        )
        self._process = process

    def wait_ready(self) -> None:
        """Send the tokenizer (the process reads it once its imports are done), then wait
        for its "ready"."""
        process = self._process
        try:
            if process is None:
                raise RuntimeError("a grammar worker was not launched")
            for frame in self._init:
                _write(process, frame)
            if _read(process, _START_S) != "ready":
                raise RuntimeError("a grammar worker did not start")
        except BaseException:
            self.stop()
            raise

    def call(self, frame: bytes, deadline: float) -> Reply:
        if self._process is None:
            self.start()
        process = self._process
        if process is None:  # start() sets it or raises
            return ["crash"]
        try:
            _write(process, frame)
            reply = _read(process, deadline)
        except (OSError, ValueError, EOFError):  # the process died under the job
            self.stop()
            return ["crash"]
        if reply is None:
            self.stop()
            return ["timeout"]
        return list(reply)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.kill()
        process.wait()
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()


def _write(process: subprocess.Popen[bytes], data: bytes) -> None:
    stdin = process.stdin
    if stdin is None:
        raise OSError("no pipe to the grammar worker")
    view = memoryview(len(data).to_bytes(4, "big") + data)
    while view:  # a pipe may take a large frame in parts
        view = view[os.write(stdin.fileno(), view) :]


def _read(process: subprocess.Popen[bytes], timeout: float) -> Any:
    """The next frame, decoded; None when none came within `timeout` seconds; EOFError when
    the process closed its end."""
    stdout = process.stdout
    if stdout is None:
        raise OSError("no pipe from the grammar worker")
    poller = select.poll()  # not select.select: a busy router's new pipes are past fd 1024
    poller.register(stdout.fileno(), select.POLLIN)
    if not poller.poll(timeout * 1000):
        return None
    size = int.from_bytes(_exactly(stdout.fileno(), 4), "big")
    return json.loads(_exactly(stdout.fileno(), size))


def _exactly(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            raise EOFError("the grammar worker closed its pipe")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
