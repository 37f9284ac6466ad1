"""`--weights auto`: whether a quantized GGUF stays in its blocks, by measurement on this CPU.

Decode is bound by the bytes of weights each step reads, and a block-quantized matrix is a
quarter to a half of its bf16 bytes, but its kernels also unpack it: which wins depends on the
CPU. So the file's most common kind of layer matrix (the (type, shape) holding the most bytes,
such as a Q4_K_M file's Q4_K gate/up projections) is timed both ways at the row counts of decode
steps, with the same measurement as the kernel choice (`kernel_choice.measure`: every kernel
each way, the least time of many rounds): kept in its blocks, and expanded to the model's dtype.
The blocks stay if they are at least as fast per decoded token. Where the expanded weights would
not fit comfortably in memory the blocks stay whatever the timing. The timing is cached beside
the kernel choice (by machine and sample matrix), so a restart does not time again; on a machine
too busy to time anything (the kernel choice's load guard) with nothing cached, a file whose
expanded weights fit is expanded, and a later, quieter start times it.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

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
DECODE_ROWS = 32  # decode steps: the kernel choice's buckets of 1, 8 and 32 rows


def keep_quantized(path: str | Path, dtype: torch.dtype, cache_dir: Path | None = None) -> bool:
    """Whether `--weights auto` keeps this checkpoint's blocks (False: not a quantized GGUF).
    The timed answer is cached in `cache_dir` (by machine and sample matrix), unless the machine
    was too busy to time anything."""
    file = quantized_gguf(path)
    if file is None:
        return False
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if 2 * expanded_bytes(file, itemsize) > 0.5 * available_memory():  # packs at load: 2x
        log.info("weights_auto", chose="quantized", why="the expanded weights would not fit")
        return True
    tensor = sample_tensor(file)
    sample = f"{tensor.tensor_type.name} {tensor.shape[1]}x{tensor.shape[0]}"
    cached = _cache_path(cache_dir, sample, dtype)
    timed = read_cached(cached) if cached is not None else None
    if not _is_timing(timed):
        load = kernel_choice.machine_load()
        if load > kernel_choice.BUSY_LOAD:  # a busy machine's timings decide nothing
            log.info("weights_auto", chose=_name(dtype), load=round(load, 2),
                     why="too busy to measure: expanded, as the weights fit")
            return False
        kept, expanded = decode_seconds(tensor, dtype)
        timed = {"kept_us_per_row": round(kept * 1e6, 2),
                 "expanded_us_per_row": round(expanded * 1e6, 2)}
        if cached is not None:
            write_cached(cached, timed)
    assert isinstance(timed, dict)
    keep = bool(timed["kept_us_per_row"] <= timed["expanded_us_per_row"])
    log.info("weights_auto", chose="quantized" if keep else _name(dtype), sample=sample,
             cached=cached is not None and cached.exists(), **timed)
    return keep


def sample_tensor(file: Path) -> GGUFTensor:
    """The file's most common kind of layer matrix: the (type, shape) holding the most bytes."""
    groups: dict[tuple[str, tuple[int, ...]], list[GGUFTensor]] = defaultdict(list)
    for t in open_gguf(file).tensors:
        if t.name.startswith("blk.") and t.tensor_type.name in TYPE_IDS and len(t.shape) == 2:
            groups[(t.tensor_type.name, tuple(t.shape))].append(t)
    return max(groups.values(), key=lambda g: len(g) * g[0].n_bytes)[0]


def decode_seconds(tensor: GGUFTensor, dtype: torch.dtype) -> tuple[float, float]:
    """Seconds per row, summed over the decode buckets, of this matrix kept in its blocks and
    expanded to `dtype` (each its fastest kernel at each bucket)."""
    weight, blocks = (gguf_tensor(tensor, keep_quantized=keep) for keep in (False, True))
    assert isinstance(weight, torch.Tensor) and isinstance(blocks, QuantWeight)
    dense = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    dense.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
    return per_row(QuantLinear(blocks, None)), per_row(dense)


def _cache_path(cache_dir: Path | None, sample: str, dtype: torch.dtype) -> Path | None:
    if cache_dir is None:
        return None
    key = kernel_choice.machine_key(sample, _name(dtype), str(kernel_choice.BUCKETS[:3]))
    return cache_dir / f"weights-{key}.json"


def _is_timing(data: object) -> bool:
    return isinstance(data, dict) and all(
        isinstance(data.get(k), float | int) for k in ("kept_us_per_row", "expanded_us_per_row"))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def per_row(layer: Linear | QuantLinear) -> float:
    """The layer's fastest kernel at each decode bucket, its seconds per row, summed."""
    timings = kernel_choice.measure(layer, DECODE_ROWS)
    total = 0.0
    for b, rows in enumerate(kernel_choice.BUCKETS):
        best = [t[b] for t in timings.values() if t[b] is not None]
        if best:
            total += min(best) / rows  # type: ignore[type-var, operator]
    return total
