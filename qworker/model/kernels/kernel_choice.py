"""Which matmul each linear layer runs, chosen by measurement on this CPU, not by assumption.

At warm-up every distinct (output, input, dtype) shape of the model is timed with each kernel
this CPU can run for it (the native GEMM of the loaded level, oneDNN through torch with the weight
prepacked) at a few token counts (`BUCKETS`); each layer then runs, for a step of m rows, the
fastest kernel of m's bucket. The choice is cached on disk, keyed by CPU, flags, threads, torch,
native build and shapes, so a restart does not measure again; but not a choice measured too
noisily to tell the kernels apart (a busy machine): that one serves this process only, and a later
start measures again. At every bucket a decode-only step can take, the decode graph's kernels
are kept where they cost the model little more than the fastest (`GRAPH_MARGIN`).
`QWORKER_KERNELS` set to a family skips the measurement: that family wherever it serves.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import structlog
import torch

from qworker.model.kernels import native
from qworker.model.kernels import native_build as nb

BUCKETS = (1, 8, 32, 128, 512)  # rows a step's matmul is timed at
EDGES = [math.sqrt(a * b) for a, b in zip(BUCKETS, BUCKETS[1:], strict=False)]
ROUNDS = 7  # at least; then more, up to MAX_ROUNDS, until each kernel ran MEASURE_S in all:
MEASURE_S, MAX_ROUNDS = 0.02, 200  # a call of 0.1 ms is timed 200 times, one of 10 ms 7 times
Timer = Callable[[str, int, Callable[[], object]], float]  # (kind, rows, run) -> s of one call
# Two kernels whose best times are this close are as good as each other: whichever is kept, and
# however noisy their rounds, the choice costs at most this much.
QUIET_SPREAD = 0.10
# Over this many runnable threads a CPU (the 1-minute load, before measuring), the machine is busy:
# its rounds are rarely whole. At a load of 3-4 on 2 vCPUs every call of ~0.1 ms took one or two
# 4 ms scheduler slices, the same in every round: the halves agreed and could not see the noise.
BUSY_LOAD = 1.0
GRAPH_KINDS = frozenset({*native.PACKED_KINDS, *native.QUANT_METHODS})  # the decode graph's
# The decode graph saves ~45% of a one-row step's matmul time: SmolLM2-135M float32, one thread,
# AMD EPYC Zen 1 at a load of 4-4.7 (benchmarks.single_stream, native forced: 62.4 / 85.2 ms a
# token against 84.2 / 110.5 layer by layer, two runs; benchmarks.kernels' matmuls 48.7 ms). Kept
# at about half that, for the noise of those figures: a choice that turns the graph off at one
# row must make the matmuls more than 25% faster.
GRAPH_MARGIN = 0.25

log = structlog.get_logger(__name__)


class Layer(Protocol):
    """What takes a measured choice (`linear.Linear`, `quant_linear.QuantLinear`)."""

    out_features: int
    in_features: int

    @property
    def input_dtype(self) -> torch.dtype: ...

    @property
    def weight_format(self) -> str: ...

    def kernels(self) -> tuple[str, ...]: ...

    def run(self, kind: str, x: torch.Tensor) -> torch.Tensor: ...

    def set_choice(self, choice: tuple[str, ...]) -> None: ...


def bucket(rows: int) -> int:
    """Index of the bucket nearest to `rows` on a log scale."""
    return bisect.bisect_left(EDGES, rows)


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


class Seconds(float):
    """A kernel's time of one call, the least of its rounds; and `halves`, the least of the odd
    and of the even rounds."""

    halves: tuple[float, float]

    def __new__(cls, rounds: Sequence[float]) -> Seconds:
        assert rounds
        self = super().__new__(cls, min(rounds))
        self.halves = (min(rounds[0::2]), min(rounds[1::2] or rounds))
        return self


def undecided(timings: Mapping[str, Sequence[float | None]]) -> list[int]:
    """The buckets measured too noisily to tell the two fastest kernels apart: their best times
    differ by more than QUIET_SPREAD, but the faster is not faster in both halves of the rounds
    (where every round was slowed alike, by a neighbour holding a core for whole scheduler
    slices, the rounds agree and their least is chance). Closer kernels are as good
    as each other, so a wide spread alone decides nothing: interference only adds time, and the
    least of the rounds already discounts it (on this 2-vCPU VM, with nothing else running, most
    shapes' rounds spread over 10%, and flagging them left no choice ever cached). Plain floats,
    as tests give, are exact."""
    out = []
    for b, column in enumerate(zip(*timings.values(), strict=True)):
        times = sorted(t for t in column if t is not None)
        if len(times) < 2:
            continue
        first, second = times[:2]
        gap = second / first - 1 if first > 0 else 0.0
        halves = zip(getattr(first, "halves", (first, first)),
                     getattr(second, "halves", (second, second)), strict=True)
        if gap > QUIET_SPREAD and any(f >= s for f, s in halves):
            out.append(b)
    return out


def keep_graph_kernels(chosen: Mapping[str, tuple[str, ...]],
                       timings: Mapping[str, Mapping[str, Sequence[float | None]]],
                       counts: Mapping[str, int],
                       graph_rows: int = 1) -> dict[str, tuple[str, ...]]:
    """At each bucket a decode-only step can take (up to `graph_rows` rows: the batch's most
    sequences), every shape on its fastest kernel that the decode graph runs, where that costs
    the model's matmuls (each shape's time by its layer count) at most GRAPH_MARGIN more than
    the fastest kernels there: the graph runs only where every layer chose one of its kernels,
    and it saves more than that (one shape on oneDNN at 8-512 rows took every batched decode
    step off the graph: workload v1 1.00x vLLM CPU against 1.28-1.30x with the graph, Intel
    AMX Xeon, 2026-12-03). A bucket where some shape has no such kernel stays as measured."""
    out = {key: list(kinds) for key, kinds in chosen.items()}
    for b in range(bucket(max(graph_rows, 1)) + 1):
        picks = _graph_picks(chosen, timings, counts, b)
        for key, kind in (picks or {}).items():
            out[key][b] = kind
    return {key: tuple(kinds) for key, kinds in out.items()}


def _graph_picks(chosen: Mapping[str, tuple[str, ...]],
                 timings: Mapping[str, Mapping[str, Sequence[float | None]]],
                 counts: Mapping[str, int], b: int) -> dict[str, str] | None:
    """Bucket b's graph kernel for each shape, or None where the graph would cost too much."""
    picks: dict[str, str] = {}
    graph_total = fastest_total = 0.0
    for key, kinds in chosen.items():
        times = {kind: x for kind, t in timings[key].items() if (x := t[b]) is not None}
        graph = [kind for kind in times if kind in GRAPH_KINDS]
        if not graph or kinds[b] not in times:
            return None
        picks[key] = min(graph, key=times.__getitem__)
        graph_total += counts[key] * times[picks[key]]
        fastest_total += counts[key] * times[kinds[b]]
    return picks if graph_total <= (1 + GRAPH_MARGIN) * fastest_total else None


def machine_load() -> float:
    """The 1-minute load average per CPU of the machine (0 where unknown)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 0.0


def one_call(kind: str, rows: int, run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def measure(layer: Layer, max_rows: int,
            timer: Timer = one_call) -> dict[str, list[float | None]]:
    """Seconds per call (`Seconds`) of each kernel the layer can run, at every bucket up to
    max_rows."""
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


def _rounds(runs: Mapping[str, Callable[[], object]], rows: int,
            timer: Timer) -> dict[str, Seconds]:
    """Each kernel's rounds, the kernels taking turns in each so that a busy neighbour slows
    them alike. Kept is the least time, as timeit and benchmark tools do: interference only ever
    adds time, so the least is the best this CPU achieves (on 2 vCPUs shared, an OpenMP call is
    slowed whenever one of its threads is not scheduled: most rounds of a busy machine). Short
    calls get more rounds: a round with all threads scheduled at once is rare there."""
    times: dict[str, list[float]] = {kind: [] for kind in runs}
    for done in range(MAX_ROUNDS):
        if done >= ROUNDS and min(sum(t) for t in times.values()) >= MEASURE_S:
            break
        for kind, run in runs.items():
            times[kind].append(timer(kind, rows, run))
    return {kind: Seconds(t) for kind, t in times.items()}


def shape_key(layer: Layer) -> str:
    return f"{layer.out_features}x{layer.in_features}:{layer.weight_format}"


def choose(layers: Iterable[tuple[Layer, int]], cache_dir: Path | None,
           timer: Timer = one_call, graph_rows: int = 1) -> dict[str, tuple[str, ...]]:
    """Sets every layer's `choice` (layers given with the most rows a step gives each); returns
    the choice by shape. Layers of one shape share one measurement. `graph_rows`: the most rows
    of a decode-only step the decode graph may run (0: it never runs this model, and its kernels
    are not favoured)."""
    by_shape: dict[str, list[Layer]] = {}
    rows_of: dict[str, int] = {}
    for layer, rows in layers:
        if len(layer.kernels()) > 1:
            key = shape_key(layer)
            by_shape.setdefault(key, []).append(layer)
            rows_of[key] = max(rows_of.get(key, 0), rows)
    path = _cache_path(cache_dir, rows_of, graph_rows)
    chosen = _read(path) or (_unsaved.get(path) if path is not None else None)
    if chosen is None or set(chosen) != set(by_shape) or any(
            not set(chosen[key]) <= set(group[0].kernels()) for key, group in by_shape.items()):
        load = machine_load()
        timings = {key: measure(group[0], rows_of[key], timer) for key, group in by_shape.items()}
        chosen = {key: fastest(t) for key, t in timings.items()}
        if graph_rows > 0:
            chosen = keep_graph_kernels(chosen, timings,
                                        {key: len(group) for key, group in by_shape.items()},
                                        graph_rows)
        noisy = {key: [BUCKETS[b] for b in buckets] for key, t in timings.items()
                 if (buckets := undecided(t))}
        if noisy or load > BUSY_LOAD:  # one file holds every shape: none is kept
            log.warning("kernel_choice_too_noisy_not_cached", rows_by_shape=noisy,
                        load_per_cpu=round(load, 2))  # a later, quieter start measures again
            if path is not None:
                _unsaved[path] = chosen  # this process's later engines do not measure again
        else:
            _write(path, chosen)
    for key, group in by_shape.items():
        for layer in group:
            layer.set_choice(chosen[key])
    return chosen


# choices measured too noisily to be written, by the cache file they would have gone to
_unsaved: dict[Path, dict[str, tuple[str, ...]]] = {}


def _cache_path(cache_dir: Path | None, rows_of: Mapping[str, int],
                graph_rows: int) -> Path | None:
    if cache_dir is None:
        return None
    key = machine_key(json.dumps(sorted(rows_of.items())), str(BUCKETS),
                      f"graph kept at {bucket(graph_rows) + 1 if graph_rows else 0} buckets")
    return cache_dir / f"kernels-{key}.json"


def machine_key(*parts: str) -> str:
    """A cache key of what a timing on this machine depends on (CPU, flags, threads, torch, the
    native level and its source) and of `parts`."""
    status = native.status()
    machine = [nb.cpu_model(), " ".join(sorted(nb.cpu_flags())), str(torch.get_num_threads()),
               torch.__version__, str(status.level), nb.source_hash()]
    return hashlib.sha256("\0".join([*machine, *parts]).encode()).hexdigest()[:16]


def _read(path: Path | None) -> dict[str, tuple[str, ...]] | None:
    data = read_cached(path) if path is not None else None
    if not isinstance(data, dict):
        return None
    return {k: tuple(v) for k, v in data.items()
            if isinstance(v, list) and len(v) == len(BUCKETS)}


def _write(path: Path | None, chosen: Mapping[str, tuple[str, ...]]) -> None:
    if path is not None:
        write_cached(path, {k: list(v) for k, v in chosen.items()})


def read_cached(path: Path) -> object:
    """A cached measurement's JSON (None where absent or unreadable)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_cached(path: Path, data: object) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")  # renamed: readers see all or none
        partial.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(partial, path)
    except OSError as exc:  # a read-only home: measured again at the next start
        log.warning("measurement_not_cached", path=str(path), reason=str(exc))


def describe(chosen: Mapping[str, tuple[str, ...]]) -> dict[str, str]:
    """shape -> "kernel@bucket,...", for logs and the info metric."""
    return {key: ",".join(f"{k}@{b}" for k, b in zip(kinds, BUCKETS, strict=True))
            for key, kinds in chosen.items()}
