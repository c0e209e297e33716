"""No function takes more than 6 positional parameters (STYLE.md rule 3: past ~6, a concept
is missing). `self`/`cls` and keyword-only parameters (after `*`) do not count; Triton
kernels are exempt (a kernel's arguments are its launch ABI)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHECKED = ("libs", "services", "bench", "scripts")
MAX_POSITIONAL = 6
# Offenders that predate this check, as "path:function". The list only shrinks: a new
# function over the limit fails the test; a fixed one's entry can go.
KNOWN = {
    "libs/common/engine/model/kv_cache.py:__init__",
    "libs/common/transfer/tcp/engine.py:_finish_part",
    "libs/common/transfer/tcp/frame.py:pack_request",
    "libs/common/transfer/tcp/server.py:__init__",
    "libs/common/transfer/tcp/server.py:_apply",
    "libs/common/worker/kv_sender.py:__init__",
    "services/decode/service.py:_pump",
    "services/decode/stream.py:__init__",
}


def _positional(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    params = [*node.args.posonlyargs, *node.args.args]
    if params and params[0].arg in ("self", "cls"):
        params = params[1:]
    return len(params)


def _is_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in node.decorator_list)


def offenders() -> dict[str, int]:
    """'path:function' -> its positional parameter count, for each function over the limit."""
    found = {}
    for folder in CHECKED:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    if _positional(node) > MAX_POSITIONAL and not _is_kernel(node):
                        found[f"{path.relative_to(REPO)}:{node.name}"] = _positional(node)
    return found


def test_no_new_function_takes_more_than_six_positional_parameters():
    new = {name: n for name, n in offenders().items() if name not in KNOWN}
    assert not new, f"over {MAX_POSITIONAL} positional parameters (group them, or use `*`): {new}"


def test_no_router_function_takes_more_than_six_positional_parameters():
    assert [name for name in offenders() if name.startswith("services/router/")] == []


def test_self_and_keyword_only_parameters_are_not_counted():
    a, b = ast.parse(
        "def a(self, p1, p2, p3, p4, p5, p6, *, k1, k2): pass\n"
        "def b(p1, p2, p3, p4, p5, p6, p7): pass\n"
    ).body
    assert _positional(a) == MAX_POSITIONAL and _positional(b) == MAX_POSITIONAL + 1
