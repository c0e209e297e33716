"""A grammar pool's worker process: `python -m libs.common.grammar.worker` (pool.py starts it).

It reads frames on stdin and writes frames on stdout; a frame is a 4-byte big-endian length
and that many bytes. First a JSON frame `[vocab_size, [eos ids], log level, log format]`,
then the tokenizer's JSON as one frame; the worker answers "ready". Then jobs, one at a
time:

    {"param": "ebnf", "items": [["ebnf", "root ::= ..."], ...]}   (kinds: build.from_source)
    -> ["ok", [text, ...]]                 each item built and compiled, in order
    -> ["err", index, param, message]      the first item refused (GrammarError)

JSON both ways: nothing is unpickled or evaluated. The worker exits when stdin closes.
A job that runs too long is the pool's to stop (it kills the process).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import BinaryIO

from libs.common.grammar.build import GrammarError, from_source
from libs.common.grammar.compiler import GrammarCompiler
from libs.common.log import setup_logging


def read_frame(stream: BinaryIO) -> bytes | None:
    """One frame's bytes, or None at the end of the stream."""
    head = stream.read(4)
    if len(head) < 4:
        return None
    size = int.from_bytes(head, "big")
    data = stream.read(size)
    return data if len(data) == size else None


def write_frame(stream: BinaryIO, data: bytes) -> None:
    stream.write(len(data).to_bytes(4, "big") + data)
    stream.flush()


def answer(compiler: GrammarCompiler, job: dict) -> list:
    """A job's reply: every item built and compiled, or the first one refused."""
    param, texts = job["param"], []
    for i, (kind, source) in enumerate(job["items"]):
        try:
            text = from_source(kind, source, param)
            compiler.check(text, param)
        except GrammarError as e:
            return ["err", i, e.param, str(e)]
        except Exception as e:  # the converter's own errors: refused, the worker serves on
            return ["err", i, param, f"'{param}': the grammar could not be checked ({e})"]
        texts.append(text)
    return ["ok", texts]


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the router's Ctrl-C is the router's
    # The frames own the real stdout; anything else printed (logs) goes to stderr.
    stdin, stdout = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    head, tokenizer = read_frame(stdin), read_frame(stdin)
    if head is None or tokenizer is None:
        return
    vocab_size, eos, level, fmt = json.loads(head)
    setup_logging(level, fmt, service="grammar-worker")
    compiler = GrammarCompiler(tokenizer.decode(), vocab_size, tuple(eos))
    write_frame(stdout, b'"ready"')
    while (frame := read_frame(stdin)) is not None:
        reply = answer(compiler, json.loads(frame))
        write_frame(stdout, json.dumps(reply).encode())


if __name__ == "__main__":
    main()
