"""The router's rooms (services/router/README.md): routing/, structured/ and admission/
import no room above them, so each can be read, and tested, alone."""

from __future__ import annotations

import ast

import pytest

from tests.test_code_shape import REPO, imported_modules

ROUTER = REPO / "services" / "router"
ROOMS = ("api", "admission", "requests", "routing", "structured")
LOWER = ("admission", "routing", "structured")  # they import libs/ and the shared modules


def rooms_imported(room: str) -> set[str]:
    found = set()
    for path in (ROUTER / room).rglob("*.py"):
        for name in imported_modules(path):
            parts = name.split(".")
            if parts[:2] == ["services", "router"] and len(parts) > 2 and parts[2] in ROOMS:
                if parts[2] != room:
                    found.add(parts[2])
    return found


@pytest.mark.parametrize("room", LOWER)
def test_a_lower_room_imports_no_other_room(room):
    assert rooms_imported(room) == set()


def test_every_router_package_has_a_docstring_and_no_logic():
    for init in ROUTER.rglob("__init__.py"):
        tree = ast.parse(init.read_text())
        assert ast.get_docstring(tree), init
        assert not [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)], init
