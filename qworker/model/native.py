"""Native CPU kernels, compiled from `csrc/` with the system's C++ compiler on first use.

The shared library is cached under the qworker home, keyed by source, flags and CPU, and loaded
with ctypes: no Python headers, no torch headers, a one-second build. It links OpenMP, which
resolves to the runtime torch already loaded, so both share one thread pool. Without a compiler
(or with `QWORKER_NATIVE=0`) callers get None and use their torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import structlog
import torch

from qworker.model.hub import qworker_home

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math", "-shared", "-fPIC", "-std=c++17")
KERNELS = {
    torch.float32: "qw_decode_attention_f32",
    torch.float64: "qw_decode_attention_f64",
    torch.bfloat16: "qw_decode_attention_bf16",
}

log = structlog.get_logger(__name__)


@functools.cache
def library() -> ctypes.CDLL | None:
    if os.environ.get("QWORKER_NATIVE", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        log.warning("native_kernels_unavailable", reason="no C++ compiler (set CXX)")
        return None
    target = qworker_home() / "native" / f"decode_attention-{_build_key(compiler)}.so"
    if not target.exists():
        try:
            _compile(compiler, target)
        except (OSError, subprocess.CalledProcessError) as exc:
            log.warning("native_kernels_unavailable", reason=str(exc))
            return None
    lib = ctypes.CDLL(str(target))
    for name in KERNELS.values():
        getattr(lib, name).argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_double]
    return lib


def _build_key(compiler: str) -> str:
    cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = next((line for line in cpu.splitlines() if line.startswith("flags")), "")
    parts = [SOURCE.read_bytes(), " ".join(FLAGS).encode(), compiler.encode(),
             platform.machine().encode(), flags.encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _compile(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target, then rename: concurrent workers never load a half-written file
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)], check=True,
                       capture_output=True, timeout=300)
        os.replace(built, target)


def serves(cache: torch.Tensor) -> bool:
    """Whether the native kernels take a cache of this dtype and device."""
    return cache.device.type == "cpu" and cache.dtype in KERNELS and library() is not None


def decode_attention(
    q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Attends each query row to its sequence's cached keys; q: [D, heads, head_dim] (rows may be
    strided) -> [D, heads, head_dim]. Only for caches that `serves` accepts."""
    lib = library()
    assert lib is not None and serves(cache_k) and q.dtype == cache_k.dtype
    num, heads, head_dim = q.shape
    kv_heads, num_blocks, block_size, _ = cache_k.shape
    assert q.stride(2) == 1 and q.stride(1) == head_dim, "q heads must be packed"
    assert cache_k.is_contiguous() and cache_v.is_contiguous()
    tables = block_tables.contiguous()
    lens = context_lens.contiguous()
    assert tables.dtype == lens.dtype == torch.int64
    out = torch.empty((num, heads, head_dim), dtype=q.dtype)
    shape = torch.tensor([num, tables.shape[1], heads, kv_heads, head_dim, num_blocks,
                          block_size, q.stride(0)], dtype=torch.int64)
    getattr(lib, KERNELS[q.dtype])(q.data_ptr(), cache_k.data_ptr(), cache_v.data_ptr(),
                         tables.data_ptr(), lens.data_ptr(), out.data_ptr(), shape.data_ptr(),
                         scale)
    return out
