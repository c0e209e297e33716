"""The kernels on ARM64 (the neon, neon-dotprod and generic builds), correctness only: each
build of tests/engine/model/kernels_driver.c (kernels.c's entry points on fixed inputs, then
a greedy decode of a tiny random model through them) runs under qemu-aarch64-static and
prints its results, which must agree with the x86-64 builds' (the generic one, the
reference, and avx2 where the CPU runs it) within each kernel's tolerance, and give the
same tokens. Timings under qemu mean nothing and none are taken.

Needs Debian's gcc-aarch64-linux-gnu, libc6-dev-arm64-cross and qemu-user-static
(`make cross-tools`; CI installs them): skipped, with the reason, without them."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from libs.common.engine.model.quant import native

CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64-static"
DRIVER = Path(__file__).with_name("kernels_driver.c")
ARM64_BUILDS = ("neon", "neon-dotprod", "generic")
# Every build computes these to the bit: element-wise, or no arithmetic on the values.
EXACT = ("dequant", "round_x16", "argmax", "rope", "swiglu", "rms_norm.residual", "tokens")

# A real /proc/cpuinfo of an ARM64 host (Neoverse N1) and of one without dot products.
CPUINFO_N1 = (
    "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 "
    "atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs\nCPU implementer\t: 0x41\n"
)
CPUINFO_A53 = "processor\t: 0\nFeatures\t: fp asimd evtstrm crc32 cpuid\nCPU part\t: 0xd03\n"


def test_arm64_builds_are_chosen_from_cpuinfo_features():
    assert native.choose_variant(native.parse_cpu_flags(CPUINFO_N1), "aarch64") == "neon-dotprod"
    assert native.choose_variant(native.parse_cpu_flags(CPUINFO_A53), "aarch64") == "neon"
    assert native.choose_variant(frozenset(), "aarch64") == "generic"
    assert list(native.variants("aarch64")) == ["neon-dotprod", "neon", "generic"]  # best first
    assert native.choose_variant(native.parse_cpu_flags(CPUINFO_N1), "x86_64") == "generic"


def test_only_the_simd_builds_take_the_neon_paths():
    """-DTQ_NEON opts into the intrinsics: every ARM64 CPU has NEON, and the generic build
    must stay the plain C reference."""
    assert "-DTQ_NEON" not in native.compile_flags("generic", "aarch64")
    assert "-DTQ_NEON" in native.compile_flags("neon", "aarch64")
    assert "-march=armv8.2-a+dotprod" in native.compile_flags("neon-dotprod", "aarch64")


def _tools_missing() -> str | None:
    if platform.machine() != "x86_64":
        return f"compares ARM64 builds under qemu with x86-64 ones; this is {platform.machine()}"
    missing = [tool for tool in (CROSS_CC, QEMU, "cc") if shutil.which(tool) is None]
    if missing:
        return (f"{', '.join(missing)} not installed (`make cross-tools`: gcc-aarch64-linux-gnu, "
                "libc6-dev-arm64-cross, qemu-user-static)")  # fmt: skip
    return None


def needs_cross_tools(test):
    """Slow (builds 5 programs, runs 3 under qemu: ~20 s) and skipped without the tools."""
    skip = pytest.mark.skipif(_tools_missing() is not None, reason=str(_tools_missing()))
    return pytest.mark.slow(skip(test))


def _build(name: str, folder: Path) -> Path:
    """The driver compiled with the flags native.py gives build `name` ("arm64-neon", ...)."""
    machine, variant = name.split("-", 1)
    arm = machine == "arm64"
    flags = native.compile_flags(variant, "aarch64" if arm else "x86_64")
    out = folder / name
    cmd = [CROSS_CC if arm else "cc", *flags, *(["-static"] if arm else []),
           f"-I{native.SOURCE.parent}", str(DRIVER), "-o", str(out), "-lm"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0, done.stderr
    return out


def _run(name: str, binary: Path) -> dict[str, np.ndarray]:
    cmd = [QEMU, "-cpu", "max", str(binary)] if name.startswith("arm64") else [str(binary)]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=180, env=env)
    assert done.returncode == 0, done.stderr
    lines = [line.split() for line in done.stdout.splitlines()]
    return {words[0]: np.array([float(v) for v in words[1:]]) for words in lines}


@pytest.fixture(scope="module")
def binaries(tmp_path_factory) -> dict[str, Path]:
    """build name -> the driver built for it."""
    folder = tmp_path_factory.mktemp("arm64")
    names = ["x86-generic", *(f"arm64-{b}" for b in ARM64_BUILDS)]
    if native.VARIANTS["avx2"][1] <= native.cpu_flags():
        names.append("x86-avx2")
    return {name: _build(name, folder) for name in names}


@pytest.fixture(scope="module")
def results(binaries) -> dict[str, dict[str, np.ndarray]]:
    """build name -> the driver's output (line name -> values)."""
    return {name: _run(name, binary) for name, binary in binaries.items()}


@needs_cross_tools
def test_each_arm64_build_multiplies_with_its_instructions(binaries):
    """neon-dotprod has sdot, neon smlal, generic neither (beyond what the statically
    linked C library brings, the same in each)."""
    objdump = shutil.which("aarch64-linux-gnu-objdump") or "objdump"
    counts = {}
    for build in ARM64_BUILDS:
        cmd = [objdump, "-d", str(binaries[f"arm64-{build}"])]
        text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        counts[build] = {op: text.count(f"\t{op}\t") for op in ("sdot", "smlal", "smlal2")}
    base = counts["generic"]
    assert counts["neon-dotprod"]["sdot"] > base["sdot"], counts
    assert counts["neon"]["sdot"] == base["sdot"], counts
    assert counts["neon"]["smlal"] > base["smlal"] and counts["neon"]["smlal2"] > base["smlal2"]


def _relative(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / max(np.abs(ref).max(), 1e-30))


def _tolerance(key: str, x16_against_fp32: bool) -> float:
    if key.startswith(EXACT):
        return 0.0
    if key.startswith("logits"):  # after 2 layers of a random model
        return 2e-3
    if x16_against_fp32 and key.startswith(("gemv", "gemm")):
        return 1e-4  # x's rounding to 16 bits in the SIMD builds (test_quant.py's bound)
    return 1e-5  # summation order


@needs_cross_tools
@pytest.mark.parametrize("build", ARM64_BUILDS)
def test_every_entry_point_on_arm64_agrees_with_x86(results, build):
    """Against x86 generic (fp32 x), and the SIMD builds also against x86 avx2 (x rounded
    to 16 bits as theirs): gemv, gemm, dequant_rows, rms_norm, rope, swiglu, argmax,
    decode_attention (fp32/bf16/fp16 K/V), round_x16, and the decode's last logits."""
    ours = results[f"arm64-{build}"]
    refs = [("x86-generic", build != "generic")]
    if build != "generic" and "x86-avx2" in results:
        refs.append(("x86-avx2", False))
    for ref_name, x16_against_fp32 in refs:
        ref = results[ref_name]
        assert ours.keys() == ref.keys()  # an entry point that failed prints nothing
        for key, values in ref.items():
            assert ours[key].shape == values.shape, key
            if key == "margins":  # the top-2 gaps: shown when tokens differ, not compared
                continue
            bound = _tolerance(key, x16_against_fp32)
            if bound == 0.0:
                np.testing.assert_array_equal(ours[key], values, err_msg=f"{key} vs {ref_name}")
            else:
                assert _relative(ours[key], values) <= bound, (key, ref_name)


@needs_cross_tools
def test_neon_and_neon_dotprod_compute_the_same_bits(results):
    """sdot on x split into two int8 planes gives smlal's integers: every result equal."""
    neon, dotprod = results["arm64-neon"], results["arm64-neon-dotprod"]
    assert neon.keys() == dotprod.keys()
    for key in neon:
        np.testing.assert_array_equal(neon[key], dotprod[key], err_msg=key)


@needs_cross_tools
@pytest.mark.parametrize("build", ARM64_BUILDS)
def test_on_arm64_a_row_has_the_same_bits_alone_or_beside_others(results, build):
    """tq_gemv's first row alone and with 2 more; tq_gemm's first 5 rows in 5 and in 7."""
    out = results[f"arm64-{build}"]
    for kind in ("2", "3", "8", "12", "13", "14"):
        one, three = out[f"gemv.{kind}.m1"], out[f"gemv.{kind}.m3"]
        np.testing.assert_array_equal(one, three[: one.size], err_msg=kind)
        five, seven = out[f"gemm.{kind}.m5"], out[f"gemm.{kind}.m7"]
        np.testing.assert_array_equal(five, seven[: five.size], err_msg=kind)


@needs_cross_tools
def test_greedy_tokens_are_the_same_on_every_build(results):
    """x86 generic (the reference) against ARM64 neon, neon-dotprod and generic: 17 tokens
    of a 2-layer random model (every block format, bf16 K/V) through tq_dequant_rows,
    tq_decode_layer, tq_rms_norm, tq_gemv and tq_argmax_rows."""
    ref = results["x86-generic"]["tokens"]
    assert ref.size == 17 and len(set(ref.tolist())) > 8  # a decode, not one token repeated
    for name, out in results.items():
        assert out["tokens"].tolist() == ref.tolist(), (name, out["margins"].tolist())
