"""The quantized-product kernels (kernels.c): built per instruction set, chosen at start-up.

Builds of the one C translation unit (kernels.c, which #includes its parts, the *.h files
beside it), per machine: on x86-64 `avx512vnni` (x86-64-v4 plus AVX512-VNNI), `avx512`
(x86-64-v4), `avx2` (x86-64-v3: AVX2, FMA, F16C) and `generic` (x86-64-v2); on ARM64
`neon-dotprod` (armv8.2-a with the dot product instructions), `neon` (armv8-a) and
`generic` (the same target without the NEON intrinsics); elsewhere `generic` (the
compiler's default target). `library()` picks the best one the CPU's flags allow (x86:
/proc/cpuinfo's `flags`; ARM64: its `Features`, asimd and asimddp), logs the choice
(`quant.kernels`), and loads it with ctypes. `TANDEM_KERNELS=<variant>` forces a build
instead (to run and time the avx2 kernels on an AVX-512 host, say); a variant the CPU
cannot run is refused.

Where the builds live: $TANDEM_KERNEL_DIR when set (an image builds them there ahead of
time: `python -m libs.common.engine.model.quant.native DIR`), else
~/.cache/tandem/kernels/<hash of the sources and flags>/, built on first use with the
host's C compiler (`cc`, ~1 s each; concurrent workers build into temporary names and
rename). The library links against the OpenMP runtime torch loaded (torch/lib/libgomp),
so its parallel loops and torch's share one pool of threads: `torch.set_num_threads`
governs both.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile

import structlog

log = structlog.get_logger(__name__)

SOURCE = pathlib.Path(__file__).with_name("kernels.c")
_COMMON_FLAGS = [
    "-O3", "-fPIC", "-fopenmp", "-std=c11",
    # Let the compiler reorder float sums (vector reductions); no NaN/inf assumptions.
    "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
]  # fmt: skip
# name -> (compiler flags, CPU flags it needs), best first.
_V4 = frozenset(
    {"avx512f", "avx512bw", "avx512cd", "avx512vl", "avx512dq", "avx2", "fma", "f16c", "bmi1",
     "bmi2", "movbe"}
)  # fmt: skip
VARIANTS: dict[str, tuple[list[str], frozenset[str]]] = {
    # VNNI's vpdpwssd: the batch products' int16 multiply-adds in one instruction
    "avx512vnni": (
        ["-march=x86-64-v4", "-mavx512vnni", "-mprefer-vector-width=512"],
        _V4 | {"avx512_vnni"},
    ),
    "avx512": (["-march=x86-64-v4", "-mprefer-vector-width=512"], _V4),
    "avx2": (["-march=x86-64-v3"], frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})),
    "generic": ([], frozenset()),
}
# ARM64: NEON (asimd) is in every CPU; the intrinsics paths are opted into with TQ_NEON so
# that `generic` stays the plain C reference. Dot products (sdot) need asimddp.
ARM64_VARIANTS: dict[str, tuple[list[str], frozenset[str]]] = {
    "neon-dotprod": (["-march=armv8.2-a+dotprod", "-DTQ_NEON"], frozenset({"asimd", "asimddp"})),
    "neon": (["-march=armv8-a", "-DTQ_NEON"], frozenset({"asimd"})),
    "generic": (["-march=armv8-a"], frozenset()),
}
_X86 = ("x86_64", "AMD64")
_ARM64 = ("aarch64", "arm64")


def variants(machine: str | None = None) -> dict[str, tuple[list[str], frozenset[str]]]:
    """The builds for a machine (platform.machine() by default), best first."""
    machine = machine or platform.machine()
    if machine in _X86:
        return VARIANTS
    if machine in _ARM64:
        return ARM64_VARIANTS
    return {"generic": ([], frozenset())}


# tq_panel_products() -> how a batch of 5+ rows is multiplied with Q4_0 / Q4_1 / Q8_0
BATCH_PRODUCTS = {0: "fp32-tiles", 1: "int16-panels", 2: "int16-panels-vnni", 3: "int16-panels-256"}


class KernelsUnavailable(RuntimeError):
    """No build of the kernels can be loaded here (no compiler and no prebuilt library)."""


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return parse_cpu_flags(text)


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The first CPU's flags in /proc/cpuinfo's text: `flags` on x86, `Features` on ARM64."""
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def choose_variant(flags: frozenset[str], machine: str | None = None) -> str:
    """The best build for the machine whose instructions the CPU has (at worst generic)."""
    return next(name for name, (_, needs) in variants(machine).items() if needs <= flags)


def compile_flags(variant: str, machine: str | None = None) -> list[str]:
    """The C compiler's flags for a variant on a machine (platform.machine() by default)."""
    machine = machine or platform.machine()
    extra = variants(machine)[variant][0]
    if machine in _X86:
        extra = extra or ["-march=x86-64-v2"]
    return [*_COMMON_FLAGS, *extra]


def _torch_lib() -> pathlib.Path:
    import torch

    return pathlib.Path(torch.__file__).parent / "lib"


def sources() -> list[pathlib.Path]:
    """kernels.c and the parts it #includes (every *.h beside it): a build depends on each."""
    return [SOURCE, *sorted(SOURCE.parent.glob("*.h"))]


def _cache_dir() -> pathlib.Path:
    digest = hashlib.sha256()
    for path in sources():  # a change to any part (or a part added) is another build
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    for variant in variants():
        digest.update(" ".join(compile_flags(variant)).encode())
    base = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache"))
    return base / "tandem" / "kernels" / digest.hexdigest()[:16]


def build(variant: str, folder: pathlib.Path) -> pathlib.Path:
    """Compile one variant into folder/tq_<variant>.so (atomically); returns its path."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise KernelsUnavailable(
            "no C compiler (cc) to build the quantized kernels: install gcc, point "
            "TANDEM_KERNEL_DIR at prebuilt ones, or run with --weights fp32"
        )
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"tq_{variant}.so"
    torch_lib = _torch_lib()
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        obj, lib = pathlib.Path(tmp) / "k.o", pathlib.Path(tmp) / "k.so"
        # Compiled with -fopenmp, linked without it: the OpenMP runtime is torch's.
        steps = [
            [cc, *compile_flags(variant), "-c", str(SOURCE), "-o", str(obj)],
            [cc, "-shared", str(obj), "-o", str(lib), f"-L{torch_lib}", "-l:libgomp.so.1",
             f"-Wl,-rpath,{torch_lib}", "-lm"],
        ]  # fmt: skip
        for cmd in steps:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise KernelsUnavailable(f"building the {variant} kernels failed: {done.stderr}")
        os.replace(lib, target)
    return target


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    lib.tq_gemv.argtypes = [i, p, sz, i, i, p, i, p, i]
    lib.tq_gemv.restype = i
    lib.tq_gemm.argtypes = [i, p, sz, i, i, p, i, p, i]
    lib.tq_gemm.restype = i
    lib.tq_gemm_panel.argtypes = [i, p, sz, i, i, p, i, p, i]
    lib.tq_gemm_panel.restype = i
    lib.tq_dequant_rows.argtypes = [i, p, sz, i, p, ctypes.c_int64, i, p]
    lib.tq_dequant_rows.restype = i
    lib.tq_decode_attention.argtypes = [p, p, p, i, ctypes.c_int64, ctypes.c_int64, p, p,
                                         i, i, i, i, ctypes.c_float, p]  # fmt: skip
    lib.tq_decode_attention.restype = i
    lib.tq_scatter_heads.argtypes = [p, ctypes.c_int64, i, i, i, p, p, p, i]
    lib.tq_scatter_heads.restype = i
    lib.tq_rope.argtypes = [p, ctypes.c_int64, i, i, p, p, i, p]
    lib.tq_rope.restype = i
    lib.tq_swiglu.argtypes = [p, i, i, p]
    lib.tq_swiglu.restype = i
    lib.tq_rms_norm.argtypes = [p, p, p, ctypes.c_float, i, i, p]
    lib.tq_rms_norm.restype = i
    lib.tq_block_size.argtypes = [i]
    lib.tq_block_size.restype = i
    lib.tq_block_bytes.argtypes = [i]
    lib.tq_block_bytes.restype = i
    lib.tq_round_x16.argtypes = [p, i, i, p]
    lib.tq_round_x16.restype = i
    lib.tq_activation_bits.argtypes = []
    lib.tq_activation_bits.restype = i
    lib.tq_argmax_rows.argtypes = [p, i, i, ctypes.c_int64, p]
    lib.tq_argmax_rows.restype = i
    lib.tq_panel_products.argtypes = []
    lib.tq_panel_products.restype = i
    return lib


def forced_variant() -> str | None:
    """The build `TANDEM_KERNELS` names, or None when it is unset or empty."""
    return os.environ.get("TANDEM_KERNELS", "").strip() or None


def library(variant: str | None = None) -> tuple[ctypes.CDLL, str]:
    """The loaded kernels for this CPU and the variant's name; built on first use. A
    variant named here, or else by `TANDEM_KERNELS`, is loaded instead of the best one
    the CPU's flags allow, and refused (KernelsUnavailable) if the CPU cannot run it."""
    flags = cpu_flags()
    forced = variant or forced_variant()
    if forced is None:
        return _load(choose_variant(flags), False)
    builds = variants()  # this machine's: x86-64's, ARM64's, or generic alone
    if forced not in builds:
        raise KernelsUnavailable(
            f"TANDEM_KERNELS={forced!r} is no kernel build: one of {', '.join(builds)}"
        )
    missing = sorted(builds[forced][1] - flags)
    if missing:
        raise KernelsUnavailable(
            f"this CPU cannot run the {forced} kernels (TANDEM_KERNELS): it lacks "
            f"{', '.join(missing)}; unset TANDEM_KERNELS to use the best it runs"
        )
    return _load(forced, True)


@functools.lru_cache(maxsize=4)
def _load(variant: str, forced: bool) -> tuple[ctypes.CDLL, str]:
    flags = cpu_flags()
    env_dir = os.environ.get("TANDEM_KERNEL_DIR")
    folder = pathlib.Path(env_dir) if env_dir else _cache_dir()
    path = folder / f"tq_{variant}.so"
    built = False
    if not path.exists():
        if env_dir:
            raise KernelsUnavailable(f"{path} is missing (TANDEM_KERNEL_DIR)")
        path = build(variant, folder)
        built = True
    _torch_lib()  # torch (and its OpenMP runtime) first: the library reuses that runtime
    lib = _declare(ctypes.CDLL(str(path)))
    isa = sorted(flags & {"avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx2", "fma",
                          "amx_tile", "asimd", "asimddp"})  # fmt: skip
    batch = BATCH_PRODUCTS[lib.tq_panel_products()]
    log.info("quant.kernels", variant=variant, forced=forced, path=str(path), built=built,
             cpu_flags=isa, activation_bits=lib.tq_activation_bits(),
             batch_products=batch)  # fmt: skip
    return lib, variant


def optional_library() -> ctypes.CDLL | None:
    """The kernels when they can be had, else None (logged once): for the fused RMSNorm and
    decode attention, which fall back to torch; quantized weights need `library()`. The
    build `library()` gives now (TANDEM_KERNELS is read on each call, as there)."""
    return _optional(forced_variant())


@functools.lru_cache(maxsize=4)
def _optional(forced: str | None) -> ctypes.CDLL | None:
    try:
        return library(forced)[0]
    except KernelsUnavailable as exc:
        log.warning("quant.kernels_unavailable", reason=str(exc), fallback="torch")
        return None


def main(argv: list[str]) -> int:
    """`python -m libs.common.engine.model.quant.native DIR`: build every variant in DIR."""
    if len(argv) != 1:
        print("usage: python -m libs.common.engine.model.quant.native DIR", file=sys.stderr)
        return 2
    for variant in variants():
        print(build(variant, pathlib.Path(argv[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
