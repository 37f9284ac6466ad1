"""Native CPU kernels (paged attention, fused elementwise ops, GEMM), compiled from `csrc/` with
the system's C++ compiler on first use.

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

SOURCES = Path(__file__).with_name("csrc")
# -ffast-math for the compile only: linking with it adds crtfastmath, which at load would switch
# the whole process to flush-to-zero floats (torch and every other library with it)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC", "-std=c++17")
LINK_FLAGS = ("-shared", "-fopenmp")
SUFFIXES = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16"}
_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
SIGNATURES = {
    "qw_decode_attention": [_P] * 6 + [_I] * 8 + [_D],
    "qw_prefill_attention": [_P] * 5 + [_I] * 8 + [_I, _I, _D],
    "qw_add_rms_norm": [_P] * 4 + [_I, _I, _D],
    "qw_rope_store": [_P] * 7 + [_I] * 6,
    "qw_silu_mul": [_P, _P, _I, _I],
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
    target = qworker_home() / "native" / f"qworker-kernels-{_build_key(compiler)}.so"
    if not target.exists():
        try:
            _compile(compiler, target)
        except (OSError, subprocess.SubprocessError) as exc:  # failed or timed out
            log.warning("native_kernels_unavailable", reason=str(exc))
            return None
    lib = ctypes.CDLL(str(target))
    for name, argtypes in SIGNATURES.items():
        for suffix in SUFFIXES.values():
            getattr(lib, f"{name}_{suffix}").argtypes = argtypes
    for name in ("qw_gemm_f32", "qw_gemm_bf16"):
        getattr(lib, name).argtypes = [_P] * 4 + [_I] * 3
        getattr(lib, name).restype = ctypes.c_int
    for name in ("qw_decode_step_f32", "qw_decode_step_bf16"):
        getattr(lib, name).argtypes = [_P, _P, _I, _P, _P, _P, _I, _P] + [_P] * 6 + [_I, _P, _D, _D]
        getattr(lib, name).restype = ctypes.c_int
    return lib


def _sources() -> list[Path]:
    return sorted(SOURCES.glob("*.cpp"))


def _kernel(name: str, dtype: torch.dtype) -> ctypes._CFuncPtr:
    lib = library()
    assert lib is not None and dtype in SUFFIXES, "call only where serves() is true"
    return getattr(lib, f"{name}_{SUFFIXES[dtype]}")


def _build_key(compiler: str) -> str:
    cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = next((line for line in cpu.splitlines() if line.startswith("flags")), "")
    sources = [p.read_bytes() for p in sorted(SOURCES.iterdir()) if p.is_file()]  # headers too
    parts = [*sources, " ".join(FLAGS + LINK_FLAGS).encode(), compiler.encode(),
             platform.machine().encode(), flags.encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _compile(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target, then rename: concurrent workers never load a half-written file
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        objects = []
        for source in _sources():
            objects.append(str(Path(tmp) / f"{source.stem}.o"))
            _run([compiler, *FLAGS, "-c", str(source), "-o", objects[-1]])
        _run([compiler, *LINK_FLAGS, *objects, "-o", str(built)])
        os.replace(built, target)
    for old in target.parent.glob("qworker-kernels-*.so"):  # earlier versions' builds
        if old != target:  # a process still using one keeps its mapping
            old.unlink(missing_ok=True)


def serves(cache: torch.Tensor) -> bool:
    """Whether the native kernels take a cache of this dtype and device."""
    return cache.device.type == "cpu" and cache.dtype in SUFFIXES and library() is not None


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, timeout=300)


def decode_attention(
    q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Attends each query row to its sequence's cached keys; q: [D, heads, head_dim] (rows may be
    strided) -> [D, heads, head_dim]. Only for caches that `serves` accepts."""
    assert q.dtype == cache_k.dtype
    num, heads, head_dim = q.shape
    kv_heads, num_blocks, block_size, _ = cache_k.shape
    assert q.stride(2) == 1 and q.stride(1) == head_dim, "q heads must be packed"
    assert cache_k.is_contiguous() and cache_v.is_contiguous()
    tables = block_tables.contiguous()
    lens = context_lens.contiguous()
    assert tables.dtype == lens.dtype == torch.int64
    out = torch.empty((num, heads, head_dim), dtype=q.dtype)
    _kernel("qw_decode_attention", q.dtype)(
        q.data_ptr(), cache_k.data_ptr(), cache_v.data_ptr(), tables.data_ptr(), lens.data_ptr(),
        out.data_ptr(), num, tables.shape[1], heads, kv_heads, head_dim, num_blocks, block_size,
        q.stride(0), scale,
    )
    return out


def prefill_attention(
    q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, block_table: torch.Tensor,
    num_cached: int, scale: float,
) -> torch.Tensor:
    """A chunk of one sequence, causal after `num_cached` tokens, its own K/V already in the cache;
    q: [n, heads, head_dim] (rows may be strided) -> [n, heads, head_dim]."""
    assert q.dtype == cache_k.dtype and q.stride(2) == 1 and q.stride(1) == q.shape[2]
    assert cache_k.is_contiguous() and cache_v.is_contiguous()
    num, heads, head_dim = q.shape
    kv_heads, num_blocks, block_size, _ = cache_k.shape
    table = block_table.contiguous()
    assert table.dtype == torch.int64 and table.numel() * block_size >= num_cached + num
    out = torch.empty((num, heads, head_dim), dtype=q.dtype)
    _kernel("qw_prefill_attention", q.dtype)(
        q.data_ptr(), cache_k.data_ptr(), cache_v.data_ptr(), table.data_ptr(), out.data_ptr(),
        1, table.numel(), heads, kv_heads, head_dim, num_blocks, block_size, q.stride(0),
        num_cached, num, scale,
    )
    return out


GEMM_DTYPES = {torch.float32: ("qw_gemm_f32", 1, 1), torch.bfloat16: ("qw_gemm_bf16", 2, 2)}


def gemm_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """[n, k] weight -> [n/16, k/step, 16, step] (step 2 for bfloat16: pairs along k), the
    layout `gemm` reads; None where `gemm` does not serve this weight here."""
    spec = GEMM_DTYPES.get(weight.dtype)
    n, k = weight.shape
    if (spec is None or weight.device.type != "cpu" or (lib := library()) is None
            or not lib.qw_gemm_available() & spec[1] or n % 16 or k % spec[2]):
        return None
    step = spec[2]
    return weight.detach().view(n // 16, 16, k // step, step).permute(0, 2, 1, 3).contiguous()


def gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [m, k] @ W.T + bias, W given as `gemm_pack(W)` (only where that gave a pack)."""
    lib = library()
    assert lib is not None and x.dtype == packed.dtype and x.shape[0] > 0
    x = x.contiguous()
    n, k = packed.shape[0] * 16, packed.shape[1] * packed.shape[3]
    out = torch.empty((x.shape[0], n), dtype=x.dtype)
    done = getattr(lib, GEMM_DTYPES[x.dtype][0])(
        x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
        out.data_ptr(), x.shape[0], n, k)
    assert done, "gemm_pack gave a pack the kernel does not take"
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """x += delta (in place, when given), then returns rms_norm(x) * weight; x: [n, hidden]."""
    assert x.is_contiguous() and (delta is None or delta.is_contiguous())
    out = torch.empty_like(x)
    _kernel("qw_add_rms_norm", x.dtype)(
        x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
        out.data_ptr(), x.shape[0], x.shape[1], eps,
    )
    return out


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               slots: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
               heads: int) -> None:
    """Rotates the q and k heads of qkv [n, (heads + 2 kv_heads) * d] in place with the
    [positions, d] cos/sin tables, then stores each token's k and v at its cache slot."""
    kv_heads, num_blocks, block_size, head_dim = cache_k.shape
    assert qkv.stride(1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    assert cache_k.is_contiguous() and cache_v.is_contiguous()
    _kernel("qw_rope_store", qkv.dtype)(
        qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), slots.data_ptr(),
        cache_k.data_ptr(), cache_v.data_ptr(), qkv.stride(0), qkv.shape[0], heads, kv_heads,
        head_dim, num_blocks * block_size,
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[n, 2 * inter] -> silu(gate) * up, [n, inter]."""
    assert gate_up.is_contiguous()
    n, width = gate_up.shape
    out = torch.empty((n, width // 2), dtype=gate_up.dtype)
    _kernel("qw_silu_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), n, width // 2)
    return out


DECODE_LAYER_FIELDS = 9  # per layer: input norm, qkv, qkv bias, o, post norm, gate_up, down, k, v


def decode_step(
    x: torch.Tensor, layers: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor,
    rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
    slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, dims: tuple[int, ...],
    eps: float, scale: float,
) -> torch.Tensor | None:
    """Runs every decoder layer of a decode-only step, then the final norm and the LM head of the
    given rows (csrc/decoder.cpp): logits [len(rows), vocab] in x's dtype. x [m, hidden] is
    updated in place. layers: int64 [L, 9] addresses (see DECODE_LAYER_FIELDS); lm_head: the
    `gemm_pack` of the LM head; dims: hidden, heads, kv_heads, head_dim, intermediate,
    num_blocks, block_size. None, computing nothing, where the build does not serve these shapes."""
    assert x.dtype in GEMM_DTYPES and x.is_contiguous() and norm.is_contiguous()
    assert layers.dtype == torch.int64 and layers.shape[1] == DECODE_LAYER_FIELDS
    assert tables.dtype == lens.dtype == rows.dtype == torch.int64
    assert tables.is_contiguous() and lens.is_contiguous() and rows.is_contiguous()
    assert cos.is_contiguous() and sin.is_contiguous()
    vocab = lm_head.shape[0] * 16
    logits = torch.empty((rows.shape[0], vocab), dtype=x.dtype)
    shape = (ctypes.c_int64 * 9)(*dims, tables.shape[1], vocab)
    done = _kernel("qw_decode_step", x.dtype)(
        x.data_ptr(), layers.data_ptr(), layers.shape[0], norm.data_ptr(), lm_head.data_ptr(),
        rows.data_ptr(), rows.shape[0], logits.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), lens.data_ptr(), x.shape[0],
        shape, eps, scale)
    return logits if done else None
