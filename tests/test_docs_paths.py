"""The docs name only what exists, and the map of the house names every package.

A path in docs/*.md, the READMEs or a package's docstring that names a file or folder of
this tree must exist: from the project's root (`services/router/api/app.py`), as the tail
of one (`model/linear.py`), or as a file name found somewhere in the tree (`kv_index.py`).
docs/architecture.md names every package of libs/, services/ and llm_programs/.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CODE_ROOTS = ("libs", "services", "llm_programs")
SKIPPED_DIRS = {".git", ".venv", "__pycache__", ".peers", "node_modules", ".mypy_cache"}

# A path-like word: slash-separated names ending in a source or config suffix, or a
# folder written with its trailing slash. Placeholders (`<name>`, `*`, `{id}`) are skipped.
_PATH = re.compile(
    r"(?<![\w./<{*-])((?:[A-Za-z0-9_.-]+/)*[A-Za-z0-9_-]+"
    r"(?:\.(?:py|md|yaml|yml|toml|txt|c|sh|json|cfg)|/))(?![\w<{*])"
)
# A module named by its file path and an attribute (`libs/common/engine/core/kv_hash.PageHasher`)
# or dotted (`services.router.service`, `libs.common.engine.core.kv_hash.PageHasher`).
_ROOTS = "libs|services|llm_programs|bench|scripts"
_SUFFIXES = "py|md|yaml|yml|toml|txt|c|sh|json|cfg|png|jsonl"
_SLASH_ATTR = re.compile(rf"(?<![\w./])((?:{_ROOTS})(?:/\w+)+)\.(?!(?:{_SUFFIXES})\b)[A-Za-z_]\w*")
_DOTTED = re.compile(rf"(?<![\w./])((?:{_ROOTS})(?:\.\w+)+)")
# Files named in prose that are not this tree's (other projects', or made at run time).
_FOREIGN = re.compile(
    r"(^|/)(\.venv|\.peers|\.git|run|bench/results|tmp|proc|sys|dev|etc|usr|opt|home|root|"
    r"var|models|shared|traces|\.\.|~)(/|$)|^https?:|^(Dockerfile|README\.md|DESIGN\.md)$"
)


def _tree() -> tuple[set[str], set[str]]:
    """Every file and folder of the tree, as paths from the root (folders with a slash)."""
    files: set[str] = set()
    dirs: set[str] = set()
    for top, subdirs, names in os.walk(REPO):
        subdirs[:] = [d for d in subdirs if d not in SKIPPED_DIRS]
        rel = Path(top).relative_to(REPO)
        dirs.update(f"{(rel / d).as_posix()}/" for d in subdirs)
        files.update((rel / n).as_posix() for n in names)
    return files, dirs


def _exists(name: str, files: set[str], dirs: set[str]) -> bool:
    known = files | dirs
    if name in known:
        return True
    if "/" not in name.rstrip("/"):
        # A bare module name is somewhere in the tree; a bare data file name (`mt.json`) is
        # an example of the user's, not a claim about the tree.
        return not name.endswith(".py") or any(k.endswith("/" + name) for k in known)
    return any(k.endswith("/" + name) for k in known)


def _named_paths(text: str) -> set[str]:
    names = set()
    for block in [*re.findall(r"`([^`\n]+)`", text), text]:
        for match in _PATH.finditer(block):
            name = match.group(1)
            if _FOREIGN.search(name) or name.startswith((".", "-")) or "//" in name:
                continue
            names.add(name)
    return names


def _missing_modules(text: str) -> set[str]:
    """Module names (dotted, or a file path with an attribute) that name no module."""
    missing = set()
    for match in _SLASH_ATTR.finditer(text):
        path = match.group(1)
        if not ((REPO / f"{path}.py").is_file() or (REPO / path).is_dir()):
            missing.add(match.group(0))
    for match in _DOTTED.finditer(text):
        parts = match.group(1).split(".")
        where = REPO / parts[0]
        for part in parts[1:]:
            if not where.is_dir():
                break  # past a module file: the rest are its attributes
            if (where / f"{part}.py").is_file() or (where / part).is_dir():
                where = where / part if (where / part).is_dir() else where / f"{part}.py"
            elif part.islower() and not (where / "__init__.py").read_text().count(part):
                missing.add(match.group(1))  # no module, and no name the package exports
                break
            else:
                break
    return missing


def _docs() -> list[Path]:
    files, _ = _tree()
    readmes = {REPO / f for f in files if f.endswith("README.md")}
    return sorted(set((REPO / "docs").glob("*.md")) | readmes)


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_path_a_doc_names_exists(doc: Path):
    files, dirs = _tree()
    text = doc.read_text()
    missing = sorted(n for n in _named_paths(text) if not _exists(n, files, dirs))
    missing += sorted(_missing_modules(text))
    assert missing == [], f"{doc.relative_to(REPO)} names paths that do not exist"


def test_every_package_docstring_names_existing_paths():
    files, dirs = _tree()
    missing = []
    for init in sorted(REPO.glob("*/**/__init__.py")):
        if init.parts[len(REPO.parts)] not in CODE_ROOTS:
            continue
        text = init.read_text()
        bad = {n for n in _named_paths(text) if not _exists(n, files, dirs)}
        missing += [f"{init.relative_to(REPO)}: {n}" for n in sorted(bad | _missing_modules(text))]
    assert missing == []


def test_architecture_names_every_package():
    text = (REPO / "docs" / "architecture.md").read_text()
    packages = sorted(
        init.parent.relative_to(REPO).as_posix() + "/"
        for root in CODE_ROOTS
        for init in (REPO / root).rglob("__init__.py")
        if "__pycache__" not in init.parts
    )
    # A package is named by its whole path, or by its tail inside its parent's row
    # (`api/` in the row of `services/router/`) as long as the parent is named whole.
    unnamed = [p for p in packages if p not in text and f"`{p.split('/')[-2]}/`" not in text]
    assert unnamed == [], "docs/architecture.md does not name these packages"


def test_architecture_walks_one_request_in_at_most_twelve_steps():
    text = (REPO / "docs" / "architecture.md").read_text()
    walk = text.split("## One request, end to end", 1)[1].split("\n## ", 1)[0]
    steps = re.findall(r"^(\d+)\. ", walk, flags=re.M)
    assert 0 < len(steps) <= 12
    assert [int(s) for s in steps] == list(range(1, len(steps) + 1))
    for step in re.split(r"^\d+\. ", walk, flags=re.M)[1:]:
        assert re.search(r"`[\w/]+\.py`", step), f"a step names no file: {step[:60]!r}"
