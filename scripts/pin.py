"""Soft pins of prefixes in the KV pool, for operators: the router's /v1/pins from a shell.

    python -m scripts.pin add --system "You are ..." --ttl 86400 [--label support-bot]
    python -m scripts.pin add --file prompt.txt --ttl 3600        # a completion's prompt
    python -m scripts.pin add --messages-file chat.json --ttl 600 # chat messages (JSON list)
    python -m scripts.pin add --system "..." --ttl 600 --cache-salt <salt>  # a tenant's pages
    python -m scripts.pin list [--json]
    python -m scripts.pin rm <pin id>

`--url` (default $TANDEM_ROUTER_URL or http://127.0.0.1:8000) is a router; `--api-key`
(default $TANDEM_API_KEY) its key when it has any. A pin lasts its TTL (pinning the same
prefix again renews it); the master refuses pins over its bounds (--max-pins,
--max-pinned-fraction, --max-pin-ttl) and this command prints why and exits 1.
docs/pool.md, "Soft pinning". The standard library only (it runs in any container).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any


class PinError(Exception):
    """The router refused (its error message) or could not be reached."""


def request(url: str, api_key: str, method: str, path: str, body: Any = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"{url.rstrip('/')}{path}", data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            error = json.loads(e.read())["error"]
            why = error["message"] + (f" (param: {error['param']})" if error.get("param") else "")
        except (ValueError, KeyError, TypeError):
            why = e.reason
        raise PinError(f"{e.code}: {why}") from None
    except OSError as e:
        raise PinError(f"router {url} unreachable: {e}") from None


def pin_body(args: argparse.Namespace) -> dict[str, Any]:
    if args.system is not None:
        body: dict[str, Any] = {"messages": [{"role": "system", "content": args.system}]}
    elif args.messages_file is not None:
        with open(args.messages_file) as f:
            body = {"messages": json.load(f)}
    elif args.file is not None:
        with open(args.file) as f:
            body = {"prompt": f.read()}
    else:
        body = {"prompt": args.text}
    body["ttl_s"] = args.ttl
    if args.label:
        body["label"] = args.label
    if args.cache_salt:
        body["cache_salt"] = args.cache_salt
    return body


def table(listed: dict) -> str:
    rows = [("id", "label", "pages", "present", "held", "MiB", "expires in")]
    now = time.time()
    for p in listed["data"]:
        rows.append((p["id"], p.get("label", "")[:30], str(p["pages"]), str(p["present"]),
                     str(p["held"]), f"{p['bytes'] / 2**20:.1f}",
                     f"{max(0, p['expires_at'] - now):.0f} s"))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.append(f"held {listed['held_bytes'] / 2**20:.1f} MiB of "
                 f"{listed['budget_bytes'] / 2**20:.1f} MiB allowed")  # fmt: skip
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scripts.pin", description=__doc__.split("\n")[0])
    p.add_argument("--url", default=os.environ.get("TANDEM_ROUTER_URL", "http://127.0.0.1:8000"))
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY", ""))
    sub = p.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add", help="pin a prefix for --ttl seconds (or renew its pin)")
    source = add.add_mutually_exclusive_group(required=True)
    source.add_argument("--system", help="a system prompt, rendered as chat messages are")
    source.add_argument("--messages-file", help="a JSON list of chat messages")
    source.add_argument("--file", help="a file whose text is a completion's prompt")
    source.add_argument("--text", help="a completion's prompt")
    add.add_argument("--ttl", type=float, required=True, help="seconds the pin lasts")
    add.add_argument("--label", default="", help="a name shown in the list")
    add.add_argument("--cache-salt", default="", help="the requests' cache_salt (docs/api.md)")
    listing = sub.add_parser("list", help="live pins")
    listing.add_argument("--json", action="store_true", help="the API's JSON, not a table")
    rm = sub.add_parser("rm", help="unpin")
    rm.add_argument("pin_id")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "add":
            out = request(args.url, args.api_key, "POST", "/v1/pins", pin_body(args))
            print(json.dumps(out, indent=2))
        elif args.command == "list":
            listed = request(args.url, args.api_key, "GET", "/v1/pins")
            print(json.dumps(listed, indent=2) if args.json else table(listed))
        else:
            out = request(args.url, args.api_key, "DELETE", f"/v1/pins/{args.pin_id}")
            print(json.dumps(out, indent=2))
    except (PinError, OSError, ValueError) as e:
        print(f"pin {args.command}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
