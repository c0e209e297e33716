"""The pyverbs shim gives one flat set of verbs constants for old and new rdma-core."""

from __future__ import annotations

import enum
import sys
import types

import pytest

from libs.common.transfer.rdma.shim import ENUMS, load_enums

VALUES = {name: i + 1 for i, name in enumerate(ENUMS)}


def _install(monkeypatch: pytest.MonkeyPatch, **modules: types.ModuleType) -> None:
    package = types.ModuleType("pyverbs")
    package.__path__ = []  # a package, so submodule imports resolve via sys.modules
    monkeypatch.setitem(sys.modules, "pyverbs", package)
    for name in ("enums", "libibverbs_enums"):
        monkeypatch.delitem(sys.modules, f"pyverbs.{name}", raising=False)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, f"pyverbs.{name}", module)
        setattr(package, name, module)


def test_rdma_core_44_flat_enums_module(monkeypatch: pytest.MonkeyPatch) -> None:
    old = types.ModuleType("pyverbs.enums")
    for name, value in VALUES.items():
        setattr(old, name, value)
    _install(monkeypatch, enums=old)
    assert vars(load_enums()) == VALUES


def test_rdma_core_50_enum_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    new = types.ModuleType("pyverbs.libibverbs_enums")
    for cls in set(ENUMS.values()):
        members = {n: VALUES[n] for n, c in ENUMS.items() if c == cls}
        setattr(new, cls, enum.IntEnum(cls, members))
    _install(monkeypatch, libibverbs_enums=new)
    assert vars(load_enums()) == VALUES


def test_no_pyverbs_is_an_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch)
    with pytest.raises(ImportError):
        load_enums()
