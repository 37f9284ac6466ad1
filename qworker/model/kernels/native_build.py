"""Building the native kernels (`csrc/`): one shared library per instruction-set level, at install
time (`make install`, the wheel, the Docker image) into the package's own `native_lib/`, or on
first use into the qworker home where no installed build fits.

A build for a level never uses instructions beyond it, so an image built on one CPU runs on any
other: at run time `native.py` loads the highest level this CPU has (`QWORKER_KERNELS` forces
one). `python -m qworker.model.kernels.native_build [DIR]` builds every level.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

SOURCES = Path(__file__).with_name("csrc")
INSTALLED = Path(__file__).with_name("native_lib")
MANIFEST = "manifest.json"
# -ffast-math for the compile only: linking with it adds crtfastmath, which at load would switch
# the whole process to flush-to-zero floats (torch and every other library with it)
COMMON_FLAGS = ("-O3", "-mtune=generic", "-fopenmp", "-ffast-math", "-fPIC", "-std=c++17")
LINK_FLAGS = ("-shared", "-fopenmp")


@dataclass(frozen=True)
class Level:
    name: str
    march: tuple[str, ...]  # compiler flags
    needs: frozenset[str]  # /proc/cpuinfo flags the CPU must have


_AVX2 = ("-march=x86-64-v2", "-mavx", "-mavx2", "-mfma", "-mf16c")
_AVX512 = (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl")
_AVX512_NEEDS = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl"})
# best first; every level's kernels are a superset of the next one's
# (every CPU with AVX512-BF16 has AVX512-VNNI too: Cooper Lake and later, Zen 4 and later; the
# quantized kernels' 16-bit dots use its fused multiply-add)
LEVELS = (
    Level("amx", (*_AVX512, "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16"),
          _AVX512_NEEDS | {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"}),
    Level("avx512_bf16", (*_AVX512, "-mavx512bf16", "-mavx512vnni"),
          _AVX512_NEEDS | {"avx512_bf16", "avx512_vnni"}),
    Level("avx512", _AVX512, _AVX512_NEEDS),
    Level("avx2", _AVX2, frozenset({"avx2", "fma", "f16c"})),
)
# QWORKER_KERNELS names: amx is the AVX512-BF16 kernels with the AMX tiles' GEMM beside them
FAMILIES = {"avx2": ("avx2",), "avx512": ("avx512_bf16", "avx512"), "amx": ("amx",)}


def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    first_cpu = (line.partition(":") for line in text.split("\n\n")[0].splitlines())
    fields = {key.strip(): value.strip() for key, _, value in first_cpu}
    # a VM often shows only "AMD EPYC": the family and model tell Zen 1 from Zen 4 or Zen 5
    name, family, model = (fields.get(k, "?") for k in ("model name", "cpu family", "model"))
    return f"{name} (family {family}, model {model})"


def runnable_levels(flags: frozenset[str] | None = None) -> list[Level]:
    """The levels this CPU can run, best first."""
    have = cpu_flags() if flags is None else flags
    return [level for level in LEVELS if level.needs <= have]


def source_hash() -> str:
    parts = [p.name.encode() + b"\0" + p.read_bytes() for p in sorted(SOURCES.iterdir())
             if p.is_file()]
    parts.append(" ".join(COMMON_FLAGS + LINK_FLAGS).encode())
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def library_name(level: Level) -> str:
    return f"qworker-kernels-{level.name}-{source_hash()}.so"


def installed_library(level: Level, folder: Path | None = None) -> Path | None:
    """The install-time build of this level for these very sources, if there is one."""
    folder = INSTALLED if folder is None else folder
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    name = manifest.get(level.name)
    if name != library_name(level) or not (folder / name).is_file():
        return None
    return folder / name


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def build(level: Level, target: Path, cxx: str) -> None:
    """Compiles every source for `level` into `target` (written beside it, then renamed: a
    concurrent process never loads a half-written file)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        sources = sorted(SOURCES.glob("*.cpp"))
        objects = [str(Path(tmp) / f"{source.stem}.o") for source in sources]
        compiles = [[cxx, *COMMON_FLAGS, *level.march, "-c", str(source), "-o", obj]
                    for source, obj in zip(sources, objects, strict=True)]
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # one g++ per core
            list(pool.map(_run, compiles))
        built = Path(tmp) / target.name
        _run([cxx, *LINK_FLAGS, *objects, "-o", str(built)])
        os.replace(built, target)


def build_all(folder: Path | None = None, cxx: str | None = None) -> dict[str, str]:
    """Builds every level into `folder` with a manifest; older builds there are removed."""
    folder = INSTALLED if folder is None else folder
    cxx = cxx or compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler: install g++ (or set CXX) to build the kernels")
    manifest = {}
    for level in LEVELS:
        build(level, folder / library_name(level), cxx)
        manifest[level.name] = library_name(level)
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    for old in folder.glob("qworker-kernels-*.so"):
        if old.name not in manifest.values():
            old.unlink(missing_ok=True)
    return manifest


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, timeout=300)


if __name__ == "__main__":
    where = Path(sys.argv[1]) if len(sys.argv) > 1 else INSTALLED
    for level, name in build_all(where).items():
        print(f"built {level}: {where / name}")
