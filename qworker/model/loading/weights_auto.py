"""`--weights auto`: whether a quantized GGUF stays in its blocks, by measurement on this CPU.

Decode is bound by the bytes of weights each step reads, and a block-quantized matrix is a
quarter to a half of its bf16 bytes, but its kernels also unpack it, and many rows at once (a
full batch, a prefill chunk) are bound by arithmetic, where the dense GEMM is faster: which wins
depends on the CPU and the row count. So the file's most common kind of layer matrix (the (type,
shape) holding the most bytes, such as a Q4_K_M file's Q4_K gate/up projections) is timed both
ways at every row count a step takes (the kernel choice's buckets, 1 to 512 rows, with its own
measurement, `kernel_choice.measure`: every kernel each way, the least time of many rounds): kept
in its blocks, and expanded to the model's dtype. The blocks stay only where they are as fast at
every bucket (within `TIE`), so that no batch size loses: a worker fed by a queue runs full
batches whenever work waits. But the resident size stays bounded first: where expanding would
hold more than `EXPANSION_ALLOWANCE` bytes beyond the blocks (any file past ~100M parameters at
4 bits: a 1.5B Q4_K_M file's 0.98 GB would become 3.6 GB of bfloat16), or would not fit
comfortably in memory, the blocks stay whatever the timing, and a full batch runs on the
"int8x8" panels (Q4_K and Q6_K on 8-bit activations through AVX512-VNNI: 1.4-2.1x "bf16x8"
from 8 rows on Zen 5, bf16x8 being at the expanded GEMM's speed from 128 rows). A small model
such as the default SmolLM2 (98 MB, 0.23 GB more expanded) is still timed, and expands where its
cache-resident dense matrices win. A float64 model is always expanded (its dtype asks for
float64's arithmetic; the blocks' kernels compute in float32). The timing is cached beside the
kernel choice (by machine and sample matrix), so a restart does not time again; on a machine
too busy to time anything (the kernel choice's load guard) with nothing cached, a file within
the allowance is expanded, and a later, quieter start times it. `--weights quantized` keeps the
blocks regardless (a single stream at a time: 1-row steps, where the blocks win most).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch
from torch import nn

from qworker.model.kernels import kernel_choice
from qworker.model.kernels.kernel_choice import read_cached, write_cached
from qworker.model.kernels.linear import Linear
from qworker.model.kernels.quant_linear import QuantLinear
from qworker.model.kernels.quant_weight import TYPE_IDS, QuantWeight
from qworker.model.loading.gguf_checkpoint import (
    available_memory,
    expanded_bytes,
    gguf_tensor,
    open_gguf,
    quantized_gguf,
)

if TYPE_CHECKING:
    from qworker.model.loading.gguf_file import GGUFTensor

log = structlog.get_logger()
TIE = 1.05  # kept this much slower than expanded at a bucket still counts as as fast (noise)
EXPANSION_ALLOWANCE = 256 * 2**20  # the most resident bytes expanding may add to the blocks
HEAD_ROWS = 32  # the rows the LM head's choice is timed at (a busy worker's decode step)


def keep_quantized(path: str | Path, dtype: torch.dtype, cache_dir: Path | None = None) -> bool:
    """Whether `--weights auto` keeps this checkpoint's blocks (False: not a quantized GGUF).
    The timed answer is cached in `cache_dir` (by machine and sample matrix), unless the machine
    was too busy to time anything."""
    file = quantized_gguf(path)
    if file is None:
        return False
    if dtype == torch.float64:  # asked for float64's arithmetic: the kept kernels' is float32
        log.info("weights_auto", chose="float64", why="the blocks' kernels compute in float32")
        return False
    itemsize = torch.empty(0, dtype=dtype).element_size()
    expanded_size = expanded_bytes(file, itemsize)
    if expanded_size - file.stat().st_size > EXPANSION_ALLOWANCE:
        log.info("weights_auto", chose="quantized", expanded_bytes=expanded_size,
                 why="expanding would hold more than the allowance beyond the blocks")
        return True
    if 2 * expanded_size > 0.5 * available_memory():  # packs at load: 2x
        log.info("weights_auto", chose="quantized", why="the expanded weights would not fit")
        return True
    tensor = sample_tensor(file)
    sample = f"{tensor.tensor_type.name} {tensor.shape[1]}x{tensor.shape[0]}"
    cached = _cache_path(cache_dir, sample, dtype)

    def measure() -> dict[str, object]:
        kept, expanded = bucket_seconds(tensor, dtype)
        return {"kept_us_per_row": [round(t * 1e6, 3) for t in kept],
                "expanded_us_per_row": [round(t * 1e6, 3) for t in expanded]}

    timed = _cached_timing(cached, _is_timing, measure)
    if timed is None:
        log.info("weights_auto", chose=_name(dtype),
                 why="too busy to measure: expanded, as the weights fit")
        return False
    keep = all(k <= TIE * e for k, e in zip(timed["kept_us_per_row"],
                                            timed["expanded_us_per_row"], strict=True))
    log.info("weights_auto", chose="quantized" if keep else _name(dtype), sample=sample,
             cached=cached is not None and cached.exists(), **timed)
    return keep


def expand_head(path: str | Path, dtype: torch.dtype, cache_dir: Path | None = None) -> bool:
    """With the blocks kept (`keep_quantized`): whether the LM head (the output matrix, or the
    embedding it is tied to) is expanded to `dtype` all the same. A vocabulary of 150k tokens
    makes the head a quarter of a 0.6B model's weights and its largest matmul, and its kernels
    (Q6_K in a Q4_K_M file) lose to the dense GEMM from 8 rows (1.2-1.4x slower on Zen 5) while
    they tie at one; so it is expanded where that adds no more than the allowance and the
    expanded head is faster (beyond TIE) at HEAD_ROWS rows, a busy worker's decode step. Timed
    and cached as the layers are; on a busy machine with nothing cached it stays kept."""
    file = quantized_gguf(path)
    head = None if file is None or dtype == torch.float64 else head_tensor(file)
    if head is None or head.tensor_type.name not in TYPE_IDS:
        return False
    extra = int(head.n_elements) * torch.empty(0, dtype=dtype).element_size() - head.n_bytes
    if extra > EXPANSION_ALLOWANCE or 2 * extra > 0.5 * available_memory():
        return False
    sample = f"head {head.tensor_type.name} {head.shape[1]}x{head.shape[0]}"
    cached = _cache_path(cache_dir, sample, dtype)

    def measure() -> dict[str, object]:
        kept, expanded = head_seconds(head, dtype)
        return {"rows": HEAD_ROWS, "kept_us_per_row": round(kept * 1e6, 3),
                "expanded_us_per_row": round(expanded * 1e6, 3)}

    timed = _cached_timing(cached, _is_head_timing, measure)
    if timed is None:
        log.info("weights_auto_head", chose="quantized", why="too busy to measure")
        return False
    expand = timed["kept_us_per_row"] > TIE * timed["expanded_us_per_row"]
    log.info("weights_auto_head", chose=_name(dtype) if expand else "quantized", sample=sample,
             **timed)
    return expand


def _cached_timing(cached: Path | None, valid: Callable[[object], bool],
                   measure: Callable[[], dict[str, object]]) -> dict[str, Any] | None:
    """A timing read from `cached`, else measured now and written there; None on a machine too
    busy to time anything (the kernel choice's load guard: its timings would decide nothing),
    and nothing written."""
    timed = read_cached(cached) if cached is not None else None
    if valid(timed):
        assert isinstance(timed, dict)
        return timed
    if kernel_choice.machine_load() > kernel_choice.BUSY_LOAD:
        return None
    timed = measure()
    if cached is not None:
        write_cached(cached, timed)
    return timed


def head_seconds(tensor: GGUFTensor, dtype: torch.dtype) -> tuple[float, float]:
    """Seconds per row of the head at HEAD_ROWS rows: kept in its blocks, expanded to `dtype`."""
    kept, expanded = bucket_seconds(tensor, dtype, HEAD_ROWS)
    return kept[-1], expanded[-1]


def head_tensor(file: Path) -> GGUFTensor | None:
    """The LM head's matrix: the output one, or the embedding a tied head shares."""
    tensors = {t.name: t for t in open_gguf(file).tensors}
    return tensors.get("output.weight", tensors.get("token_embd.weight"))


def _is_head_timing(data: object) -> bool:
    return isinstance(data, dict) and data.get("rows") == HEAD_ROWS and all(
        isinstance(data.get(k), float | int) for k in ("kept_us_per_row", "expanded_us_per_row"))


def sample_tensor(file: Path) -> GGUFTensor:
    """The file's most common kind of layer matrix: the (type, shape) holding the most bytes."""
    groups: dict[tuple[str, tuple[int, ...]], list[GGUFTensor]] = defaultdict(list)
    for t in open_gguf(file).tensors:
        if t.name.startswith("blk.") and t.tensor_type.name in TYPE_IDS and len(t.shape) == 2:
            groups[(t.tensor_type.name, tuple(t.shape))].append(t)
    return max(groups.values(), key=lambda g: len(g) * g[0].n_bytes)[0]


def bucket_seconds(tensor: GGUFTensor, dtype: torch.dtype,
                   max_rows: int = kernel_choice.BUCKETS[-1]) -> tuple[list[float], list[float]]:
    """Seconds per row at each of the kernel choice's buckets (up to `max_rows`) of this matrix
    kept in its blocks and expanded to `dtype` (each its fastest kernel at each bucket)."""
    weight, blocks = (gguf_tensor(tensor, keep_quantized=keep) for keep in (False, True))
    assert isinstance(weight, torch.Tensor) and isinstance(blocks, QuantWeight)
    dense = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    dense.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
    return per_row(QuantLinear(blocks, None, dtype), max_rows), per_row(dense, max_rows)


def _cache_path(cache_dir: Path | None, sample: str, dtype: torch.dtype) -> Path | None:
    if cache_dir is None:
        return None
    key = kernel_choice.machine_key(sample, _name(dtype), str(kernel_choice.BUCKETS))
    return cache_dir / f"weights-{key}.json"


def _is_timing(data: object) -> bool:
    return isinstance(data, dict) and all(
        isinstance(v := data.get(k), list) and len(v) == len(kernel_choice.BUCKETS)
        and all(isinstance(t, float | int) for t in v)
        for k in ("kept_us_per_row", "expanded_us_per_row"))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def per_row(layer: Linear | QuantLinear, max_rows: int = kernel_choice.BUCKETS[-1]
            ) -> list[float]:
    """The layer's fastest kernel at each bucket up to `max_rows`, its seconds per row."""
    timings = kernel_choice.measure(layer, max_rows)
    buckets = [rows for rows in kernel_choice.BUCKETS if rows <= max_rows]
    return [min(x for t in timings.values() if (x := t[b]) is not None) / rows
            for b, rows in enumerate(buckets)]
