"""The shape of the code: which packages may import which."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> list[str]:
    """Absolute names of the modules `path` imports (relative imports resolved)."""
    package = path.relative_to(REPO).with_suffix("").parts[:-1]
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names += [module] + [f"{module}.{alias.name}" for alias in node.names]
    return names


def test_no_service_imports_another_services_package():
    """Roles that share code compose libs/common, never each other."""
    crossings = set()
    for path in (REPO / "services").glob("*/**/*.py"):
        own = path.relative_to(REPO).parts[1]
        for name in imported_modules(path):
            parts = name.split(".")
            if parts[0] == "services" and len(parts) > 1 and parts[1] != own:
                if (REPO / "services" / parts[1]).is_dir():
                    crossings.add(f"{path.relative_to(REPO)} imports services.{parts[1]}")
    assert sorted(crossings) == []


def test_the_library_never_imports_a_service():
    found = {
        f"{path.relative_to(REPO)} imports {name}"
        for path in (REPO / "libs").rglob("*.py")
        for name in imported_modules(path)
        if name.split(".")[0] == "services"
    }
    assert sorted(found) == []
