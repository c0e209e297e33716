"""Decode cost of the hot wire messages: bytes -> typed message, the call receivers make.

    python -m bench.messages [--json] [--repeats 9]

Payloads are what the receivers really get:
  - `token_chunk`: one TokenChunk of one token, as a router gets token 0 from a prefill
    worker on `stream.<router>.<rid>`;
  - `token_chunk_batch_N`: a decode worker's engine step for N streams of one router, one
    token each (`chunks.<router>`), `_logprobs` with 5 alternatives per token;
  - `pool_get_reply_N`, `pool_put_start_reply_N`: the master's answers to a batch get and
    put_start of N pages (PoolClient decodes them), each object on one of two stores;
  - `pool_keys_256`, `pool_put_start_256`: the requests the master decodes.

Each figure is microseconds per decode: the median over `--repeats` runs of a loop sized
to take about 50 ms, with the garbage collector on, as in a service.
"""

from __future__ import annotations

import argparse
import functools
import gc
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import orjson

from libs.common.messages.control import TokenChunk, TokenChunkBatch, encode_chunk_batch
from libs.common.messages.pool import (
    PoolFound,
    PoolGetReply,
    PoolKeys,
    PoolNewObject,
    PoolPutStart,
    PoolPutStartReply,
    PoolReplica,
    PoolSlot,
)

WORDS = [" the", " of", " and", "ing", " model", ".", ",", "\n", " cache", " a"]
PAGE_BYTES = 16 * 2 * 2 * 16 * 64 * 4  # 16 tokens of a small model's KV, float32


def chunk_contents(n: int, logprobs: bool, seed: int = 1) -> list[dict[str, Any]]:
    """The fields of `n` one-token chunks of distinct requests (a decode step)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        token = rng.randrange(32000)
        top = [[rng.randrange(32000), -rng.random() * 5] for _ in range(5)]
        lps = [{"token": token, "logprob": -rng.random() * 3, "top": top}]
        out.append({"request_id": rng.randbytes(16).hex(), "index": rng.randrange(1, 2000),
                    "token_ids": [token], "worker": "decode-0a1b2c3d", "text": rng.choice(WORDS),
                    "logprobs": lps if logprobs else []})  # fmt: skip
    return out


def pool_contents(n: int, seed: int = 2) -> dict[str, Any]:
    """`n` objects, each on one of two stores, and the stores' descriptors."""
    rng = random.Random(seed)
    stores = ["store-0", "store-1"]
    segments = {s: {"v": 1, "transport": "tcp", "endpoint": f"10.0.0.{i + 5}:47001",
                    "region_id": rng.getrandbits(63), "length": 1 << 34,
                    "token": rng.randbytes(16).hex(), "addr": 0, "rkey": 0}
                for i, s in enumerate(stores)}  # fmt: skip
    objects = [{"key": rng.randbytes(16).hex(), "size": PAGE_BYTES,
                "checksum": rng.randbytes(8).hex(), "store": stores[i % 2],
                "offset": rng.randrange(1 << 20) * PAGE_BYTES} for i in range(n)]  # fmt: skip
    return {"objects": objects, "segments": segments, "put_id": rng.randbytes(8).hex()}


def payloads() -> dict[str, tuple[type, bytes]]:
    """name -> (the class its receiver decodes it as, the bytes on the wire)."""
    out: dict[str, tuple[type, bytes]] = {}
    (single,) = chunk_contents(1, logprobs=False, seed=3)
    out["token_chunk"] = (TokenChunk, TokenChunk(**single).encode())
    for n, lps in ((8, False), (64, False), (64, True)):
        chunks = [TokenChunk(**c).encode() for c in chunk_contents(n, lps)]
        name = f"token_chunk_batch_{n}" + ("_logprobs" if lps else "")
        out[name] = (TokenChunkBatch, encode_chunk_batch("decode-0a1b2c3d", chunks))
    for n in (16, 256):
        pool = pool_contents(n)
        objs, segs = pool["objects"], pool["segments"]
        found = [PoolFound(o["size"], o["checksum"], [PoolReplica(o["store"], o["offset"])])
                 for o in objs]  # fmt: skip
        out[f"pool_get_reply_{n}"] = (PoolGetReply, PoolGetReply(found, segs, 5.0).encode())
        slots = [PoolSlot("ok", [PoolReplica(o["store"], o["offset"])]) for o in objs]
        reply = PoolPutStartReply(pool["put_id"], slots, segs, 30.0)
        out[f"pool_put_start_reply_{n}"] = (PoolPutStartReply, reply.encode())
    objs = pool_contents(256)["objects"]
    out["pool_keys_256"] = (PoolKeys, PoolKeys([o["key"] for o in objs]).encode())
    news = [PoolNewObject(o["key"], o["size"], o["checksum"]) for o in objs]
    out["pool_put_start_256"] = (PoolPutStart, PoolPutStart(news).encode())
    return out


def per_call_us(fn: Callable[[], Any], repeats: int, target_s: float = 0.05) -> float:
    """Median microseconds per call of `fn` over `repeats` loops of ~`target_s` each."""
    gc.collect()
    number, took = 1, 0.0
    while took < target_s / 5:  # calibrate
        number *= 2
        start = time.perf_counter()
        for _ in range(number):
            fn()
        took = time.perf_counter() - start
    number = max(1, int(number * target_s / took))
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        runs.append((time.perf_counter() - start) / number * 1e6)
    return statistics.median(runs)


def measure(repeats: int) -> dict[str, dict[str, float]]:
    rows = {}
    for name, (kind, data) in payloads().items():
        kind.decode(data)  # a payload that does not decode fails here, not in the loop
        us = per_call_us(functools.partial(kind.decode, data), repeats)
        rows[name] = {"bytes": len(data), "decode_us": round(us, 3)}
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.messages",
                                     description=__doc__.split("\n")[0])  # fmt: skip
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    rows = measure(args.repeats)
    if args.json:
        report = {"host": platform.node(), "python": platform.python_version(), "rows": rows}
        sys.stdout.write(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        for name, row in rows.items():
            print(f"{name:32} {row['bytes']:>8} B  {row['decode_us']:>9.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
