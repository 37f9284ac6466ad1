"""Which matmul each linear layer runs, chosen by measurement on this CPU, not by assumption.

At warm-up every distinct (output, input, dtype) shape of the model is timed with each kernel
this CPU can run for it (the native GEMM of the loaded level, oneDNN through torch with the weight
prepacked) at a few token counts (`BUCKETS`); each layer then runs, for a step of m rows, the
fastest kernel of m's bucket. The choice is cached on disk, keyed by CPU, flags, threads, torch,
native build and shapes, so a restart does not measure again. `QWORKER_KERNELS` set to a family
skips the measurement: that family wherever it serves.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

import structlog
import torch

from qworker.model import native
from qworker.model import native_build as nb

if TYPE_CHECKING:
    from qworker.model.linear import Linear
    from qworker.model.quant_linear import QuantLinear

Layer: TypeAlias = "Linear | QuantLinear"  # what takes a measured choice

BUCKETS = (1, 8, 32, 128, 512)  # rows a step's matmul is timed at
_EDGES = [math.sqrt(a * b) for a, b in zip(BUCKETS, BUCKETS[1:], strict=False)]
ROUNDS = 7  # at least; then more, up to MAX_ROUNDS, until each kernel ran MEASURE_S in all:
MEASURE_S, MAX_ROUNDS = 0.02, 200  # a call of 0.1 ms is timed 200 times, one of 10 ms 7 times
Timer = Callable[[str, int, Callable[[], object]], float]  # (kind, rows, run) -> s of one call

log = structlog.get_logger(__name__)


def bucket(rows: int) -> int:
    """Index of the bucket nearest to `rows` on a log scale."""
    return bisect.bisect_left(_EDGES, rows)


def fastest(timings: Mapping[str, Sequence[float | None]]) -> tuple[str, ...]:
    """Per bucket, the kernel with the least time; None marks one not measured there (a bucket
    no kernel was measured at takes the fastest of the nearest bucket below it)."""
    kinds = list(timings)
    chosen: list[str] = []
    for b in range(len(BUCKETS)):
        times = {k: t for k in kinds if (t := timings[k][b]) is not None}
        if times:
            chosen.append(min(times, key=times.__getitem__))
        else:
            chosen.append(chosen[-1] if chosen else kinds[0])
    return tuple(chosen)


def one_call(kind: str, rows: int, run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def measure(layer: Layer, max_rows: int,
            timer: Timer = one_call) -> dict[str, list[float | None]]:
    """Seconds per call of each kernel the layer can run, at every bucket up to max_rows: the
    best of ROUNDS calls, the kernels taking turns (a busy neighbour slows them alike)."""
    generator = torch.Generator().manual_seed(0)
    kinds = layer.kernels()
    out: dict[str, list[float | None]] = {kind: [] for kind in kinds}
    for rows in BUCKETS:
        if rows > max(max_rows, 1):
            for kind in kinds:
                out[kind].append(None)
            continue
        x = torch.randn(rows, layer.in_features, generator=generator).to(layer.input_dtype)
        runs = {kind: (lambda k=kind, x=x: layer.run(k, x)) for kind in kinds}
        with torch.inference_mode():
            for run in runs.values():
                run()  # first call: packing, page faults
            best = _rounds(runs, rows, timer)
        for kind in kinds:
            out[kind].append(best[kind])
    return out


def _rounds(runs: Mapping[str, Callable[[], object]], rows: int, timer: Timer) -> dict[str, float]:
    """The best time of each kernel. Short calls get more rounds: on a shared machine a call
    whose threads were all scheduled at once is rare, and the best of 7 misleads."""
    best = dict.fromkeys(runs, float("inf"))
    spent = dict.fromkeys(runs, 0.0)
    for done in range(MAX_ROUNDS):
        if done >= ROUNDS and min(spent.values()) >= MEASURE_S:
            break
        for kind, run in runs.items():
            seconds = timer(kind, rows, run)
            best[kind] = min(best[kind], seconds)
            spent[kind] += seconds
    return best


def shape_key(layer: Layer) -> str:
    return f"{layer.out_features}x{layer.in_features}:{layer.weight_format}"


def choose(layers: Iterable[tuple[Layer, int]], cache_dir: Path | None,
           timer: Timer = one_call) -> dict[str, tuple[str, ...]]:
    """Sets every layer's `choice` (layers given with the most rows a step gives each); returns
    the choice by shape. Layers of one shape share one measurement."""
    by_shape: dict[str, list[Layer]] = {}
    rows_of: dict[str, int] = {}
    for layer, rows in layers:
        if len(layer.kernels()) > 1:
            key = shape_key(layer)
            by_shape.setdefault(key, []).append(layer)
            rows_of[key] = max(rows_of.get(key, 0), rows)
    path = _cache_path(cache_dir, rows_of)
    chosen = _read(path)
    if chosen is None or set(chosen) != set(by_shape) or any(
            not set(chosen[key]) <= set(group[0].kernels()) for key, group in by_shape.items()):
        chosen = {key: fastest(measure(group[0], rows_of[key], timer))
                  for key, group in by_shape.items()}
        _write(path, chosen)
    for key, group in by_shape.items():
        for layer in group:
            layer.set_choice(chosen[key])
    return chosen


def _cache_path(cache_dir: Path | None, rows_of: Mapping[str, int]) -> Path | None:
    if cache_dir is None:
        return None
    status = native.status()
    parts = [nb.cpu_model(), " ".join(sorted(nb.cpu_flags())), str(torch.get_num_threads()),
             torch.__version__, str(status.level), nb.source_hash(),
             json.dumps(sorted(rows_of.items())), str(BUCKETS)]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return cache_dir / f"kernels-{key}.json"


def _read(path: Path | None) -> dict[str, tuple[str, ...]] | None:
    try:
        data = json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    return {k: tuple(v) for k, v in data.items()
            if isinstance(v, list) and len(v) == len(BUCKETS)}


def _write(path: Path | None, chosen: Mapping[str, tuple[str, ...]]) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({k: list(v) for k, v in chosen.items()}, indent=1) + "\n")
    except OSError as exc:  # a read-only home: measured again at the next start
        log.warning("kernel_choice_not_cached", path=str(path), reason=str(exc))


def describe(chosen: Mapping[str, tuple[str, ...]]) -> dict[str, str]:
    """shape -> "kernel@bucket,...", for logs and the info metric."""
    return {key: ",".join(f"{k}@{b}" for k, b in zip(kinds, BUCKETS, strict=True))
            for key, kinds in chosen.items()}
