"""No code path can execute or unpickle what it reads: the source of libs, services, scripts
and bench is scanned (its syntax tree, so comments and docstrings may name the modules) for
deserializers that run code and for calls that evaluate strings."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("libs", "services", "scripts", "bench")
# Modules whose loaders can run arbitrary code on the bytes they are given.
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "jsonpickle",
                  "marshal", "shelve", "joblib"}  # fmt: skip
UNSAFE_BUILTINS = {"eval", "exec", "compile", "__import__"}


def _problems(path: Path, root: Path = REPO) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []

    def where(node: ast.AST) -> str:
        return f"{path.relative_to(root)}:{node.lineno}"

    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names.append(node.module)
            for name in names:
                if name.split(".")[0] in UNSAFE_MODULES:
                    out.append(f"{where(node)}: imports {name}")
        if not isinstance(node, ast.Call):
            continue
        func, keywords = node.func, {k.arg: k.value for k in node.keywords}
        if isinstance(func, ast.Name) and func.id in UNSAFE_BUILTINS:
            out.append(f"{where(node)}: calls {func.id}()")
        if not isinstance(func, ast.Attribute):
            continue
        owner = func.value.id if isinstance(func.value, ast.Name) else ""
        attr = func.attr
        if owner == "yaml" and attr in ("load", "load_all", "unsafe_load", "full_load"):
            loader = keywords.get("Loader")
            safe = isinstance(loader, ast.Attribute) and loader.attr in (
                "SafeLoader",
                "CSafeLoader",
            )
            if not safe:
                out.append(f"{where(node)}: yaml.{attr} without SafeLoader (use yaml.safe_load)")
        if owner == "torch" and attr == "load":
            weights_only = keywords.get("weights_only")
            if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                out.append(f"{where(node)}: torch.load without weights_only=True")
        if owner in ("np", "numpy") and attr == "load":
            allow = keywords.get("allow_pickle")
            if isinstance(allow, ast.Constant) and allow.value is True:
                out.append(f"{where(node)}: numpy.load with allow_pickle=True")
        shell = keywords.get("shell")
        if isinstance(shell, ast.Constant) and shell.value is True:
            out.append(f"{where(node)}: {owner}.{attr}(shell=True)")
        if owner == "os" and attr in ("system", "popen"):
            out.append(f"{where(node)}: os.{attr}()")
    return out


def test_no_code_deserializes_or_evaluates_what_it_reads():
    files = [p for d in SCANNED for p in sorted((REPO / d).rglob("*.py"))]
    assert len(files) > 50  # the scan sees the code base
    problems = [p for f in files for p in _problems(f)]
    assert not problems, "\n".join(problems)


def test_the_scan_catches_each_pattern(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import pickle\nfrom marshal import loads\nimport yaml, torch, os, subprocess\n"
        "eval('1')\nexec('x = 1')\nyaml.load(s)\nyaml.load(s, Loader=yaml.SafeLoader)\n"
        "torch.load(f)\ntorch.load(f, weights_only=True)\nos.system('ls')\n"
        "subprocess.run('ls', shell=True)\nmodel.eval()\n"
    )
    found = " ".join(_problems(bad, root=tmp_path))
    expected = [
        "imports pickle", "imports marshal", "calls eval()", "calls exec()",
        "bad.py:6: yaml.load", "bad.py:8: torch.load", "os.system", "shell=True",
    ]  # fmt: skip
    for what in expected:
        assert what in found, what
    assert "bad.py:7" not in found and "bad.py:9" not in found and "bad.py:12" not in found
