"""No function takes more than 6 positional parameters (STYLE.md rule 3: past ~6, a concept
is missing). `self`/`cls` and keyword-only parameters (after `*`) do not count; Triton
kernels are exempt (a kernel's arguments are its launch ABI)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHECKED = ("libs", "services", "bench", "scripts")
MAX_POSITIONAL = 6


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


def test_no_function_takes_more_than_six_positional_parameters():
    found = offenders()
    assert not found, (
        f"over {MAX_POSITIONAL} positional parameters (group them, or use `*`): {found}"
    )


def test_self_and_keyword_only_parameters_are_not_counted():
    a, b = ast.parse(
        "def a(self, p1, p2, p3, p4, p5, p6, *, k1, k2): pass\n"
        "def b(p1, p2, p3, p4, p5, p6, p7): pass\n"
    ).body
    assert _positional(a) == MAX_POSITIONAL and _positional(b) == MAX_POSITIONAL + 1
