"""The router's rooms (services/router/README.md) stand in floors: each imports only the
rooms below it, so a reader follows a request downwards and each room can be read, and
tested, without the ones above it."""

from __future__ import annotations

import ast

import pytest

from tests.test_code_shape import REPO, imported_modules

ROUTER = REPO / "services" / "router"
# Lowest first. state.py (the parts every handler shares) stands between dispatch/ and
# formats/: it holds a Dispatcher and the routing parts, and the rooms above read it.
FLOORS = ("routing", "structured", "dispatch", "state", "formats", "admission", "requests", "api")
ALONE = ("routing", "structured")  # on the ground floor: no other room


def rooms_imported(room: str) -> set[str]:
    """The rooms (and state.py) that the files of `room` import, itself left out."""
    paths = [ROUTER / "state.py"] if room == "state" else (ROUTER / room).rglob("*.py")
    found = set()
    for path in paths:
        for name in imported_modules(path):
            parts = name.split(".")
            if parts[:2] == ["services", "router"] and len(parts) > 2 and parts[2] in FLOORS:
                if parts[2] != room:
                    found.add(parts[2])
    return found


def test_every_room_is_on_a_floor():
    packages = {p.parent.name for p in ROUTER.glob("*/__init__.py")}
    assert packages == set(FLOORS) - {"state"}


@pytest.mark.parametrize("room", FLOORS)
def test_a_room_imports_only_the_rooms_below_it(room):
    below = set(FLOORS[: FLOORS.index(room)])
    assert rooms_imported(room) - below == set()


@pytest.mark.parametrize("room", ALONE)
def test_a_ground_floor_room_imports_no_other_room(room):
    assert rooms_imported(room) == set()


def test_every_router_package_has_a_docstring_and_no_logic():
    for init in ROUTER.rglob("__init__.py"):
        tree = ast.parse(init.read_text())
        assert ast.get_docstring(tree), init
        assert not [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)], init
