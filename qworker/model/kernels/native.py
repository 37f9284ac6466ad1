"""Native CPU kernels (paged attention, fused elementwise ops, GEMM), loaded with ctypes from
the build for the best instruction-set level this CPU runs (`native_build.py`).

The library comes from the install-time build in the package (`make install`, the wheel, the
image), else from the qworker home, built there on first use with the system's C++ compiler. It
needs no Python or torch headers, and links OpenMP, which resolves to the runtime torch already
loaded, so both share one thread pool. `QWORKER_KERNELS=torch|avx2|avx512|amx` forces a family
(`QWORKER_NATIVE=0` is `torch`). Without a library, callers get None and use their torch path,
and `status()` says why: the worker reports it at start and in its metrics.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from qworker.model.home import qworker_home
from qworker.model.kernels import native_build as nb
from qworker.model.kernels.decode_abi import DecodeDims, DecodeLayer, DecodeProj

SUFFIXES = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16"}
_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
SIGNATURES = {
    "qw_decode_attention": [_P] * 6 + [_I] * 8 + [_D, _I],
    "qw_prefill_attention": [_P] * 5 + [_I] * 8 + [_I, _I, _D, _I],
    "qw_add_rms_norm": [_P] * 4 + [_I, _I, _D],
    "qw_rms_norm_heads": [_P] * 3 + [_I] * 5 + [_D],
    "qw_rope_store": [_P] * 7 + [_I] * 6,
    "qw_silu_mul": [_P, _P, _I, _I],
    "qw_gelu_tanh_mul": [_P, _P, _I, _I],
}
KERNEL_FAMILIES = ("auto", "torch", *nb.FAMILIES)

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class NativeStatus:
    """Which native build this process runs, or why none."""

    level: str | None  # e.g. "avx2"; None: no native kernels
    origin: str  # "installed" | "home" (built or found in the qworker home) | ""
    reason: str  # why there is no library ("" when there is one)
    forced: bool  # QWORKER_KERNELS named a family: no measured choice


def kernel_family() -> str:
    family = os.environ.get("QWORKER_KERNELS", "auto").strip().lower() or "auto"
    if os.environ.get("QWORKER_NATIVE", "1") == "0":
        family = "torch"
    if family not in KERNEL_FAMILIES:
        raise ValueError(f"QWORKER_KERNELS={family!r}: choose one of {', '.join(KERNEL_FAMILIES)}")
    return family


@functools.cache
def _loaded() -> tuple[ctypes.CDLL | None, NativeStatus]:
    family = kernel_family()
    forced = family != "auto"
    if family == "torch":
        return None, NativeStatus(None, "", "QWORKER_KERNELS=torch", forced)
    levels = [lv for lv in nb.runnable_levels()
              if family == "auto" or lv.name in nb.FAMILIES[family]]
    if not levels:
        of = "" if family == "auto" else f" of {family}"
        reason = f"this CPU runs no native kernel level{of}"
        return None, NativeStatus(None, "", reason, forced)
    level = levels[0]
    path, origin = nb.installed_library(level), "installed"
    if path is None:
        path, origin = qworker_home() / "native" / nb.library_name(level), "home"
        if not path.exists():
            reason = _build_in_home(level, path)
            if reason:
                log.error("native_kernels_missing", level=level.name, reason=reason,
                          fix="run `make install` "
                              "(or python -m qworker.model.kernels.native_build)")
                return None, NativeStatus(None, "", reason, forced)
    lib = ctypes.CDLL(str(path))
    _declare(lib)
    return lib, NativeStatus(level.name, origin, "", forced)


def _build_in_home(level: nb.Level, path: Path) -> str:
    """Builds `level` at `path`; the reason it could not, or ""."""
    cxx = nb.compiler()
    if cxx is None:
        return "no installed build for these sources and no C++ compiler (set CXX) to build one"
    try:
        nb.build(level, path, cxx)
    except (OSError, subprocess.SubprocessError) as exc:  # failed, timed out, unwritable home
        return f"building into {path.parent} failed: {exc}"
    for old in path.parent.glob("qworker-kernels-*.so"):  # earlier sources' builds
        if old != path and old.name.startswith(f"qworker-kernels-{level.name}-"):
            old.unlink(missing_ok=True)  # a process still using one keeps its mapping
    return ""


def _declare(lib: ctypes.CDLL) -> None:
    for name, argtypes in SIGNATURES.items():
        for suffix in SUFFIXES.values():
            getattr(lib, f"{name}_{suffix}").argtypes = argtypes
    for name in ("qw_gemm_f32", "qw_gemm_bf16", "qw_gemm_amx_bf16"):
        getattr(lib, name).argtypes = [_P] * 4 + [_I] * 3
        getattr(lib, name).restype = ctypes.c_int
    lib.qw_amx_ready.restype = ctypes.c_int
    lib.qw_amx_attention_serves.argtypes = [_I, _I, _I]
    lib.qw_amx_attention_serves.restype = ctypes.c_int
    lib.qw_quant_gemm.argtypes = [ctypes.c_int, ctypes.c_int, _P, _I, _I, _P, _I, _P, _I]
    lib.qw_quant_gemm.restype = ctypes.c_int
    lib.qw_quant_rows.argtypes = [ctypes.c_int, _P, _P, _I, _I, _P]
    lib.qw_quant_rows.restype = ctypes.c_int
    lib.qw_quant_rows_x8.argtypes = [ctypes.c_int, _P, _P, _I, _I, _P]
    lib.qw_quant_rows_x8.restype = ctypes.c_int
    lib.qw_route.argtypes = [_P, _I, _I, _I, _I, _P, _P]
    lib.qw_logprobs_f32.argtypes = [_P, _I, _P, _I, _I, _P, _I, _P, _P, _P]
    lib.qw_argmax_f32.argtypes = [_P, _I, _I, _I, _P]
    for name in ("qw_decode_step_f32", "qw_decode_step_bf16"):
        getattr(lib, name).argtypes = [_P, ctypes.POINTER(DecodeLayer), _I, _P,
                                       ctypes.POINTER(DecodeProj), _P, _I, _P,
                                       *[_P] * 8, _I, ctypes.POINTER(DecodeDims), _D, _D]
        getattr(lib, name).restype = ctypes.c_int


def library() -> ctypes.CDLL | None:
    return _loaded()[0]


def status() -> NativeStatus:
    return _loaded()[1]


def _kernel(name: str, dtype: torch.dtype) -> Callable[..., int]:
    lib = library()
    assert lib is not None and dtype in SUFFIXES, "call only where serves() is true"
    return getattr(lib, f"{name}_{SUFFIXES[dtype]}")


def serves(cache: torch.Tensor) -> bool:
    """Whether the native kernels take a cache of this dtype and device."""
    return cache.device.type == "cpu" and cache.dtype in SUFFIXES and library() is not None


def decode_attention(
    q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, window: int | None = None,
) -> torch.Tensor:
    """Attends each query row to its sequence's cached keys (the last `window` of them, given);
    q: [D, heads, head_dim] (rows may be strided) -> [D, heads, head_dim]. Only for caches that
    `serves` accepts."""
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
        q.stride(0), scale, window or 0,
    )
    return out


def prefill_attention(
    q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, block_table: torch.Tensor,
    num_cached: int, scale: float, window: int | None = None,
) -> torch.Tensor:
    """A chunk of one sequence, causal after `num_cached` tokens (each token seeing the last
    `window` positions, given), its own K/V already in the cache; q: [n, heads, head_dim] (rows
    may be strided) -> [n, heads, head_dim]."""
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
        num_cached, num, scale, window or 0,
    )
    return out


GEMM_DTYPES = {torch.float32: ("qw_gemm_f32", 1, 1), torch.bfloat16: ("qw_gemm_bf16", 2, 2)}
PACKED_KINDS = frozenset({"native", "amx"})  # the kinds that read a `gemm_pack`
AMX_DEPTH = 32  # the k of one tile multiply: the AMX GEMM takes k in whole steps of it


@functools.cache
def amx_ready() -> bool:
    """Whether the loaded build has the AMX tiles' GEMM and this process may use the tiles."""
    lib = library()
    return lib is not None and bool(lib.qw_amx_ready())


def amx_attention_serves(group: int, head_dim: int, block_size: int) -> bool:
    """Whether a bfloat16 decode with `group` query heads a KV head runs on AMX tiles here
    (csrc/attention_amx.h); elsewhere the vector kernels of the loaded level run it."""
    lib = library()
    return lib is not None and bool(lib.qw_amx_attention_serves(group, head_dim, block_size))


def amx_serves(weight: torch.Tensor) -> bool:
    """Whether `gemm(..., amx=True)` takes this [n, k] weight here (bfloat16 only)."""
    return (weight.dtype == torch.bfloat16 and gemm_serves(weight)
            and weight.shape[1] % AMX_DEPTH == 0 and amx_ready())


def gemm_serves(weight: torch.Tensor) -> bool:
    """Whether `gemm` takes this [n, k] weight here (dtype, device, CPU, block-sized width)."""
    spec = GEMM_DTYPES.get(weight.dtype)
    n, k = weight.shape
    return not (spec is None or weight.device.type != "cpu" or (lib := library()) is None
                or not lib.qw_gemm_available() & spec[1] or n % 16 or k % spec[2])


def gemm_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """[n, k] weight -> [n/16, k/step, 16, step] (step 2 for bfloat16: pairs along k), the
    layout `gemm` reads; None where `gemm` does not serve this weight here."""
    if not gemm_serves(weight):
        return None
    n, k = weight.shape
    step = GEMM_DTYPES[weight.dtype][2]
    return weight.detach().view(n // 16, 16, k // step, step).permute(0, 2, 1, 3).contiguous()


def gemm_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight W that `packed` = `gemm_pack(W)` holds: W[ids], [len(ids), k]."""
    rows = packed[ids // 16, :, ids % 16, :]  # [len(ids), k / step, step]
    return rows.reshape(ids.shape[0], -1)


def gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
         amx: bool = False) -> torch.Tensor:
    """x [m, k] @ W.T + bias, W given as `gemm_pack(W)` (only where that gave a pack); on the AMX
    tiles where `amx` (only where `amx_serves(W)`)."""
    lib = library()
    assert lib is not None and x.dtype == packed.dtype and x.shape[0] > 0
    x = x.contiguous()
    n, k = packed.shape[0] * 16, packed.shape[1] * packed.shape[3]
    out = torch.empty((x.shape[0], n), dtype=x.dtype)
    name = "qw_gemm_amx_bf16" if amx else GEMM_DTYPES[x.dtype][0]
    done = getattr(lib, name)(
        x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
        out.data_ptr(), x.shape[0], n, k)
    assert done, "gemm_pack gave a pack the kernel does not take"
    return out


# qw_quant_gemm's methods ("...x8": on weights in the 8-row interleaved layout)
QUANT_METHODS = {"int8": 0, "dequant": 1, "int16": 2, "int16x8": 3, "dequantx8": 4, "bf16x8": 5,
                 "int8x8": 6}


def bf16_panels() -> bool:
    """Whether the loaded build has the "bf16x8" quantized method (AVX512-BF16 and above)."""
    return status().level in ("avx512_bf16", "amx")


def quant_gemm(method: str, type_id: int, x: torch.Tensor, raw: torch.Tensor,
               out: torch.Tensor) -> bool:
    """out[:, :n] = x @ W.T for W of ggml type `type_id` as its raw rows [n, row_bytes]; x
    float32 [m, k] contiguous, out float32 [m, >= n] with unit column stride. False, computing
    nothing, where the method does not serve this type or shape."""
    lib = library()
    assert lib is not None and x.dtype == out.dtype == torch.float32 and x.is_contiguous()
    assert raw.dtype == torch.uint8 and raw.is_contiguous() and out.stride(1) == 1
    return bool(lib.qw_quant_gemm(type_id, QUANT_METHODS[method], x.data_ptr(), x.shape[0],
                                  x.shape[1], raw.data_ptr(), raw.shape[0], out.data_ptr(),
                                  out.stride(0)))


def quant_rows(type_id: int, raw: torch.Tensor, ids: torch.Tensor, k: int,
               x8: bool = False) -> torch.Tensor:
    """Rows ids of W (ggml type `type_id`, raw rows [n, row_bytes], or their bytes in the x8
    layout) dequantized: float32 [t, k]."""
    lib = library()
    assert lib is not None and raw.is_contiguous()
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty((ids.shape[0], k), dtype=torch.float32)
    rows = lib.qw_quant_rows_x8 if x8 else lib.qw_quant_rows
    assert rows(type_id, raw.data_ptr(), ids.data_ptr(), ids.shape[0], k, out.data_ptr())
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


def rms_norm_heads(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, heads: int,
                   kv_heads: int, eps: float) -> None:
    """Normalises in place each of the q heads of qkv [n, (heads + 2 kv_heads) * d] by an RMSNorm
    of weight q_weight [d], and each of the k heads by one of k_weight [d]."""
    assert qkv.stride(1) == 1 and q_weight.is_contiguous() and k_weight.is_contiguous()
    assert qkv.dtype == q_weight.dtype == k_weight.dtype
    _kernel("qw_rms_norm_heads", qkv.dtype)(
        qkv.data_ptr(), q_weight.data_ptr(), k_weight.data_ptr(), qkv.stride(0), qkv.shape[0],
        heads, kv_heads, q_weight.shape[0], eps,
    )


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


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[n, 2 * inter] -> gelu_tanh(gate) * up, [n, inter] (GeGLU)."""
    assert gate_up.is_contiguous()
    n, width = gate_up.shape
    out = torch.empty((n, width // 2), dtype=gate_up.dtype)
    _kernel("qw_gelu_tanh_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), n,
                                               width // 2)
    return out


def route(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A routed-experts layer's routing (csrc/route.cpp), as the decode graph routes: logits
    [n, experts] -> each row's top k experts [n, k] (best first; a tie: the lower index) by
    softmax in float32, and their float32 weights [n, k], rescaled to sum to 1 where
    `normalize`."""
    lib = library()
    assert lib is not None
    logits = logits.float().contiguous()
    n, experts = logits.shape
    assert 1 <= k <= experts
    chosen = torch.empty((n, k), dtype=torch.int64)
    weights = torch.empty((n, k), dtype=torch.float32)
    lib.qw_route(logits.data_ptr(), n, experts, k, int(normalize), chosen.data_ptr(),
                 weights.data_ptr())
    return chosen, weights


def decode_step(
    x: torch.Tensor, layers: ctypes.Array[DecodeLayer], norm: torch.Tensor, lm_head: DecodeProj,
    vocab: int, rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
    slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, dims: DecodeDims,
    eps: float, scale: float, float_logits: bool = False,
    window_slots: torch.Tensor | None = None, window_tables: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Runs every decoder layer of a decode-only step, then the final norm and the LM head of the
    given rows (csrc/decoder.cpp): logits [len(rows), vocab] in x's dtype (float32 where
    `float_logits`: the LM head is quantized, whose kernels compute in float32). x [m, hidden] is
    updated in place. layers: one DecodeLayer per decoder layer; lm_head: the LM head's weight
    (a `gemm_pack` or quantized segments), of vocab rows; dims: the model's and the cache's sizes
    (max_blocks and vocab are set here). None, computing nothing, where the build does not serve
    these shapes (quantized projections: float32 only). window_slots / window_tables: the
    windowed KV group's, for the layers of kv_group 1 (the pool's size in dims)."""
    assert x.dtype in GEMM_DTYPES and x.is_contiguous() and norm.is_contiguous()
    assert tables.dtype == lens.dtype == rows.dtype == torch.int64
    assert tables.is_contiguous() and lens.is_contiguous() and rows.is_contiguous()
    assert cos.is_contiguous() and sin.is_contiguous()
    logits = torch.empty((rows.shape[0], vocab), dtype=torch.float32 if float_logits else x.dtype)
    dims.max_blocks, dims.vocab = tables.shape[1], vocab
    if window_tables is not None:
        assert window_slots is not None and window_tables.shape == tables.shape
        assert window_tables.dtype == window_slots.dtype == torch.int64
        assert window_tables.is_contiguous() and window_slots.is_contiguous()
    done = _kernel("qw_decode_step", x.dtype)(
        x.data_ptr(), layers, len(layers), norm.data_ptr(), ctypes.byref(lm_head),
        rows.data_ptr(), rows.shape[0], logits.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), lens.data_ptr(),
        None if window_slots is None else window_slots.data_ptr(),
        None if window_tables is None else window_tables.data_ptr(), x.shape[0], dims, eps,
        scale)
    return logits if done else None


def argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """Each row's first maximum of float32 logits [n, vocab] (csrc/argmax.cpp), as
    `logits.max(dim=-1).indices`; None where the kernel does not serve them."""
    lib = library()
    if (lib is None or logits.dtype != torch.float32 or logits.device.type != "cpu"
            or logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[1] >= 2**31):
        return None
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.qw_argmax_f32(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1],
                      out.data_ptr())
    return out


def logprobs(logits: torch.Tensor, rows: torch.Tensor, chosen: torch.Tensor, k: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows `rows` of float32 logits [*, vocab] (csrc/logprobs.cpp): the logprob of token
    chosen[r] in row rows[r] [n], and the k best logprobs and their ids [n, k], best first."""
    lib = library()
    assert lib is not None and logits.dtype == torch.float32 and logits.stride(1) == 1
    assert rows.dtype == chosen.dtype == torch.int64 and rows.shape == chosen.shape
    n, vocab = rows.shape[0], logits.shape[1]
    assert 0 <= k <= vocab
    rows, chosen = rows.contiguous(), chosen.contiguous()
    chosen_out = torch.empty(n, dtype=torch.float32)
    values = torch.empty((n, k), dtype=torch.float32)
    ids = torch.empty((n, k), dtype=torch.int64)
    lib.qw_logprobs_f32(logits.data_ptr(), logits.stride(0), rows.data_ptr(), n, vocab,
                        chosen.data_ptr(), k, chosen_out.data_ptr(), values.data_ptr(),
                        ids.data_ptr())
    return chosen_out, values, ids
