"""Forcing a build of the kernels (`TANDEM_KERNELS`): honoured when the CPU runs it, refused
by name when it cannot or when no such build exists, logged as forced."""

from __future__ import annotations

import pytest
import structlog

from libs.common.engine.model.quant import native
from libs.common.engine.model.quant.native import VARIANTS, KernelsUnavailable, cpu_flags, library


def runnable() -> list[str]:
    return [name for name, (_, needs) in VARIANTS.items() if needs <= cpu_flags()]


def test_tandem_kernels_forces_each_build_the_cpu_runs(monkeypatch):
    for variant in runnable():
        monkeypatch.setenv("TANDEM_KERNELS", variant)
        lib, chosen = library()
        assert chosen == variant
        assert lib.tq_activation_bits() == (32 if variant == "generic" else 16)
    monkeypatch.setenv("TANDEM_KERNELS", "")  # empty: the best build, as if unset
    assert library()[1] == native.choose_variant(cpu_flags())


def test_a_forced_build_is_logged_as_forced(monkeypatch):
    monkeypatch.setenv("TANDEM_KERNELS", runnable()[-1])
    native._load.cache_clear()  # the log line is written when a build is first loaded
    with structlog.testing.capture_logs() as logs:
        library()
    (line,) = [e for e in logs if e["event"] == "quant.kernels"]
    assert line["forced"] is True and line["variant"] == runnable()[-1]
    monkeypatch.delenv("TANDEM_KERNELS")
    native._load.cache_clear()
    with structlog.testing.capture_logs() as logs:
        library()
    assert [e["forced"] for e in logs if e["event"] == "quant.kernels"] == [False]


def test_a_build_the_cpu_cannot_run_is_refused_naming_what_it_lacks(monkeypatch):
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "fma", "sse4_2"}))
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("TANDEM_KERNELS", "avx512")
    with pytest.raises(KernelsUnavailable, match=r"cannot run the avx512 kernels.*avx512bw"):
        library()
    with pytest.raises(KernelsUnavailable, match="cannot run the avx512vnni"):
        library("avx512vnni")


def test_an_unknown_build_is_refused_listing_the_builds(monkeypatch):
    monkeypatch.setenv("TANDEM_KERNELS", "avx3")
    with pytest.raises(KernelsUnavailable, match=r"'avx3' is no kernel build: one of avx512vnni"):
        library()
