"""`--weights auto`: whether a quantized GGUF stays in its blocks, by measurement on this CPU.

Decode is bound by the bytes of weights each step reads, and a block-quantized matrix is a
quarter to a half of its bf16 bytes, but its kernels also unpack it: which wins depends on the
CPU. So the file's most common kind of layer matrix (the (type, shape) holding the most bytes,
such as a Q4_K_M file's Q4_K gate/up projections) is timed both ways at the row counts of decode
steps, with the same measurement as the kernel choice (`kernel_choice.measure`: every kernel
each way, the least time of many rounds): kept in its blocks, and expanded to the model's dtype.
The blocks stay if they are at least as fast per decoded token. Where the expanded weights would
not fit comfortably in memory the blocks stay whatever the timing; on a machine too busy to time
anything (the kernel choice's load guard) a file whose expanded weights fit is expanded.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import structlog
import torch
from torch import nn

from qworker.model.kernels import kernel_choice
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

log = structlog.get_logger()
DECODE_ROWS = 32  # decode steps: the kernel choice's buckets of 1, 8 and 32 rows


def keep_quantized(path: str | Path, dtype: torch.dtype) -> bool:
    """Whether `--weights auto` keeps this checkpoint's blocks (False: not a quantized GGUF)."""
    file = quantized_gguf(path)
    if file is None:
        return False
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if 2 * expanded_bytes(file, itemsize) > 0.5 * available_memory():  # packs at load: 2x
        log.info("weights_auto", chose="quantized", why="the expanded weights would not fit")
        return True
    load = kernel_choice.machine_load()
    if load > kernel_choice.BUSY_LOAD:  # a busy machine's timings decide nothing
        log.info("weights_auto", chose=str(dtype).removeprefix("torch."), load=round(load, 2),
                 why="too busy to measure: expanded, as the weights fit")
        return False
    kept, expanded, sample = decode_seconds(file, dtype)
    keep = kept <= expanded
    log.info("weights_auto", chose="quantized" if keep else str(dtype).removeprefix("torch."),
             sample=sample, kept_us_per_row=round(kept * 1e6, 2),
             expanded_us_per_row=round(expanded * 1e6, 2))
    return keep


def decode_seconds(file: Path, dtype: torch.dtype) -> tuple[float, float, str]:
    """Seconds per row, summed over the decode buckets, of the file's most common layer matrix
    kept in its blocks and expanded to `dtype` (each its fastest kernel at each bucket), and
    which matrix that is."""
    groups: dict[tuple[str, tuple[int, ...]], list[int]] = defaultdict(list)
    tensors = [t for t in open_gguf(file).tensors if t.name.startswith("blk.")
               and t.tensor_type.name in TYPE_IDS and len(t.shape) == 2]
    for i, t in enumerate(tensors):
        groups[(t.tensor_type.name, tuple(t.shape))].append(i)
    members = max(groups.values(), key=lambda g: len(g) * tensors[g[0]].n_bytes)
    tensor = tensors[members[0]]
    weight, blocks = (gguf_tensor(tensor, keep_quantized=keep) for keep in (False, True))
    assert isinstance(weight, torch.Tensor) and isinstance(blocks, QuantWeight)
    dense = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    dense.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
    kept = QuantLinear(blocks, None)
    sample = f"{tensor.tensor_type.name} {weight.shape[0]}x{weight.shape[1]}"
    return per_row(kept), per_row(dense), sample


def per_row(layer: Linear | QuantLinear) -> float:
    """The layer's fastest kernel at each decode bucket, its seconds per row, summed."""
    timings = kernel_choice.measure(layer, DECODE_ROWS)
    total = 0.0
    for b, rows in enumerate(kernel_choice.BUCKETS):
        best = [t[b] for t in timings.values() if t[b] is not None]
        if best:
            total += min(best) / rows  # type: ignore[type-var, operator]
    return total
