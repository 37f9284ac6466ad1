"""Whole decode steps weighed, on the decode graph or off it, where the kernel choice's
per-matmul picks would take a bucket's decode steps off the graph.

The kernel choice (`kernels/kernel_choice.py`) times each matmul alone; the decode graph runs a
decode-only step only where every layer chose a kernel it runs, and it saves more than any one
matmul's time (a noisy choice of oneDNN for one shape took every batched decode step off the
graph: workload v1 bf16 630 useful tok/s against 818-830 with the graph, issue #39). So at each
bucket a decode-only step takes where some layer's pick is not a graph kernel, whole steps are
timed both ways, interleaved (`graph`: each such layer on its graph kernel; `matmuls`: the picks as
measured), and the faster is kept. The verdict is cached beside the kernel choice
(`steps-<key>.json`, keyed like it by CPU, threads, torch and native build, and by the model's
shapes). A cached verdict is checked at each start by a few pairs of steps; where its winner is
clearly slower than the runner-up, that bucket is timed again and the cache rewritten. Nothing is
written, nor checked, on a busy machine (the kernel choice's load guard): its timings decide
nothing beyond this process.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog
import torch
from torch import nn

from qworker.model.batch import ForwardBatch, SequenceInput, build_batch
from qworker.model.config import ModelConfig
from qworker.model.kernels import kernel_choice
from qworker.model.kernels.kernel_choice import BUCKETS, GRAPH_KINDS, Timer
from qworker.model.kernels.linear import Linear
from qworker.model.kernels.quant_linear import QuantLinear
from qworker.model.kv_cache import KVCache

GRAPH, MATMULS = "graph", "matmuls"
MEASURE_PAIRS = 5  # interleaved pairs of steps (graph, matmuls) a verdict is made of
CHECK_PAIRS = 3  # and a cached one is checked by, at each start
LOSS = 0.10  # a cached winner this much slower than the runner-up (median of pairs) is re-timed
# Steps off the graph must be this much faster to be kept: within it the two are as good as each
# other, and the graph's one OpenMP region is the steadier (on 2 vCPUs at a load of 2 a CPU, one
# measurement put 32 rows off the graph at 0.93x, the next two on it at 0.57x and 0.78x).
GRAPH_PREFERENCE = 0.05

log = structlog.get_logger(__name__)

Picks = dict[str, str]  # shape -> kind at one bucket


class _Graph(Protocol):
    def reset(self) -> None: ...


class DecoderModel(Protocol):
    """What is weighed (`decoder.DecoderModel`, which imports this module)."""

    config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    decode_rows: int  # the most rows of a decode-only step

    @property
    def decode_graph(self) -> _Graph: ...

    def modules(self) -> Iterator[nn.Module]: ...

    def __call__(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor: ...


@dataclass(frozen=True)
class Verdict:
    """Which way a bucket's decode steps run, and why."""

    rows: int  # the bucket's rows, as timed
    winner: str  # GRAPH or MATMULS
    ratio: float  # the winner's step time over the runner-up's, median of the pairs
    source: str  # "measured", "cached", "cached, checked", "re-measured", "cached, not checked"
    ways: dict[str, Picks]  # each way's kernel by shape at this bucket
    check: float | None = None  # a cached verdict's check now: the same ratio, 3 pairs

    def as_json(self) -> dict[str, object]:
        return {"winner": self.winner, "ratio": round(self.ratio, 4), "ways": self.ways}

    def describe(self) -> str:
        checked = "" if self.check is None else f", {self.check:.2f}x at its check"
        return (f"{self.winner} at {self.rows} rows ({self.source}: "
                f"{self.ratio:.2f}x the other way's step time{checked})")


def weigh(model: DecoderModel, cache: KVCache, cache_dir: Path | None,
          timer: Timer = kernel_choice.one_call) -> dict[int, Verdict]:
    """At every bucket of a decode-only step (up to `model.decode_rows` rows) whose picks take
    the graph off, the faster way by whole steps, set on the layers; the verdicts by rows.
    `timer` times one step: (way, rows, run) -> seconds."""
    layers = _layers(model)
    path = _path(cache_dir, model, layers)
    cached = _read(path)
    load = kernel_choice.machine_load()  # the kernel choice's guard
    busy = load > kernel_choice.BUSY_LOAD
    verdicts: dict[int, Verdict] = {}
    for b in range(kernel_choice.bucket(max(model.decode_rows, 1)) + 1):
        rows = min(BUCKETS[b], max(model.decode_rows, 1))
        ways = _ways(layers, b)
        if ways is None:
            continue
        step = _decode_step(model, cache, rows)
        timed = _Timed(model, layers, b, step, timer, rows, ways)
        verdicts[BUCKETS[b]] = _verdict(timed, cached.get(str(BUCKETS[b])), busy)
    _settle(model, layers, verdicts)
    _save(path, cached, verdicts, busy, load)
    if verdicts:
        log.info("decode_steps_weighed", **{str(r): v.describe() for r, v in verdicts.items()})
    return verdicts


def _settle(model: DecoderModel, layers: Mapping[str, list[Linear | QuantLinear]],
            verdicts: Mapping[int, Verdict]) -> None:
    """Each bucket weighed on its winner's kernels; the packs no bucket runs any more dropped."""
    for verdict in verdicts.values():
        _apply(layers, kernel_choice.bucket(verdict.rows), verdict.ways[verdict.winner])
    for layer in {id(m): m for group in layers.values() for m in group}.values():
        if layer.choice is not None:
            layer.set_choice(layer.choice)
    model.decode_graph.reset()


def _save(path: Path | None, cached: Mapping[str, object], verdicts: Mapping[int, Verdict],
          busy: bool, load: float) -> None:
    """Verdicts timed now written over the cached ones (on a quiet machine only)."""
    fresh = {str(rows): v.as_json() for rows, v in verdicts.items()
             if v.source in ("measured", "re-measured")}
    if fresh and busy:
        log.warning("decode_step_choice_busy_not_cached", rows=sorted(verdicts),
                    load_per_cpu=round(load, 2))  # a later, quieter start times them again
    elif fresh and path is not None:
        kernel_choice.write_cached(path, {**cached, **fresh})


@dataclass(frozen=True)
class _Timed:
    """One bucket's two ways and a way to time them against each other."""

    model: DecoderModel
    layers: Mapping[str, list[Linear | QuantLinear]]
    bucket: int
    step: Callable[[], object]
    timer: Timer
    rows: int
    ways: dict[str, Picks]

    def ratios(self, first: str, pairs: int) -> list[float]:
        """first's step time over the other's, per interleaved pair (first, other, first, ...):
        each way set, one step untimed (its tables made, its weights in cache), one timed."""
        other = MATMULS if first == GRAPH else GRAPH
        out = []
        for _ in range(pairs):
            a, b = (self._time(way) for way in (first, other))
            out.append(a / b if b > 0 else 1.0)
        return out

    def _time(self, way: str) -> float:
        _apply(self.layers, self.bucket, self.ways[way])
        self.model.decode_graph.reset()
        self.step()
        return self.timer(way, self.rows, self.step)


def _verdict(timed: _Timed, entry: object, busy: bool) -> Verdict:
    """The bucket's verdict: the cached one where it still names these ways and, unless busy, its
    winner is not clearly slower than the runner-up now; else timed afresh."""
    cached = _cached_verdict(entry, timed)
    if cached is not None:
        if busy:
            return _with(cached, source="cached, not checked")
        check = statistics.median(timed.ratios(cached.winner, CHECK_PAIRS))
        if check <= 1 + LOSS:
            return _with(cached, source="cached, checked", check=check)
        log.warning("decode_step_choice_lost_its_check", rows=timed.rows, winner=cached.winner,
                    ratio=round(check, 3))
    graph = statistics.median(timed.ratios(GRAPH, MEASURE_PAIRS))
    off_wins = 1 / graph < 1 - GRAPH_PREFERENCE
    winner, ratio = (MATMULS, 1 / graph) if off_wins else (GRAPH, graph)
    return Verdict(timed.rows, winner, ratio, "re-measured" if cached else "measured", timed.ways)


def _cached_verdict(entry: object, timed: _Timed) -> Verdict | None:
    if not isinstance(entry, dict) or entry.get("ways") != timed.ways:
        return None  # none, or of another kernel choice
    winner, ratio = entry.get("winner"), entry.get("ratio")
    if winner not in (GRAPH, MATMULS) or not isinstance(ratio, int | float):
        return None
    return Verdict(timed.rows, str(winner), float(ratio), "cached", timed.ways)


def _with(verdict: Verdict, source: str, check: float | None = None) -> Verdict:
    return Verdict(verdict.rows, verdict.winner, verdict.ratio, source, verdict.ways, check)


def _layers(model: DecoderModel) -> dict[str, list[Linear | QuantLinear]]:
    """The model's linear layers by shape (layers of one shape share one choice; one with a
    single kernel has none, and runs it at every bucket)."""
    out: dict[str, list[Linear | QuantLinear]] = {}
    for module in model.modules():
        if isinstance(module, Linear | QuantLinear):
            out.setdefault(kernel_choice.shape_key(module), []).append(module)
    return out


def _ways(layers: Mapping[str, list[Linear | QuantLinear]], b: int) -> dict[str, Picks] | None:
    """Bucket b's picks and the graph's alternative to them; None where the picks already run
    the graph, or some shape has no graph kernel (nothing to weigh)."""
    rows = BUCKETS[b]
    if any(m.choice is None and m.kind_for(rows) not in GRAPH_KINDS
           for group in layers.values() for m in group):
        return None  # a layer of one kernel, not the graph's: no way puts the step on it
    picks = {key: group[0].kind_for(rows) for key, group in layers.items()}
    if all(kind in GRAPH_KINDS for kind in picks.values()):
        return None
    graph = {key: kind if kind in GRAPH_KINDS else _graph_kind(group[0], b)
             for key, group in layers.items() for kind in [picks[key]]}
    if any(kind is None for kind in graph.values()):
        return None
    return {GRAPH: {k: str(v) for k, v in graph.items()}, MATMULS: picks}


def _graph_kind(layer: Linear | QuantLinear, b: int) -> str | None:
    """The graph kernel the layer chose at the bucket nearest b, else the first it offers (None
    for a layer with no choice: its one kernel is not the graph's)."""
    if layer.choice is None:
        return None
    for distance in range(1, len(BUCKETS)):
        for near in (b - distance, b + distance):
            if 0 <= near < len(BUCKETS) and layer.choice[near] in GRAPH_KINDS:
                return layer.choice[near]
    return next((kind for kind in layer.kernels() if kind in GRAPH_KINDS), None)


def _apply(layers: Mapping[str, list[Linear | QuantLinear]], b: int, picks: Picks) -> None:
    """Bucket b of each layer's choice set to its shape's pick (packs are kept: see weigh)."""
    for key, group in layers.items():
        for layer in group:
            if layer.choice is None:  # its one kernel, the pick of both ways
                continue
            choice = list(layer.choice)
            choice[b] = picks[key]
            layer.choice = tuple(choice)


def _decode_step(model: DecoderModel, cache: KVCache, rows: int) -> Callable[[], object]:
    """One decode-only step of `rows` sequences, one block of context each (in blocks 1 up:
    block 0 is the warm-up's; the caller drops whatever prefix cache they held)."""
    batch = _decode_batch(cache, rows, model.device)

    def step() -> object:
        with torch.inference_mode():
            return model(batch, cache)
    return step


def _decode_batch(cache: KVCache, rows: int, device: torch.device) -> ForwardBatch:
    size = cache.block_size
    full = cache.num_blocks
    windowed = cache.blocks_of(1) if cache.num_groups > 1 else None

    def block(i: int, pool: int) -> int:
        return 1 + i % (pool - 1) if pool > 1 else 0

    seqs = [SequenceInput([i % 7], size - 1, [block(i, full)],
                          window_table=None if windowed is None else [block(i, windowed)])
            for i in range(rows)]
    return build_batch(seqs, size, device)


def _path(cache_dir: Path | None, model: DecoderModel,
          layers: Mapping[str, list[Linear | QuantLinear]]) -> Path | None:
    if cache_dir is None:
        return None
    c = model.config
    shapes = json.dumps(sorted((key, len(group)) for key, group in layers.items()))
    dims = f"{c.num_layers} {c.hidden_size} {c.num_heads} {c.num_kv_heads} {c.head_dim}"
    key = kernel_choice.machine_key(shapes, dims, str(model.dtype), str(BUCKETS), "steps v1")
    return cache_dir / f"steps-{key}.json"


def _read(path: Path | None) -> dict[str, object]:
    data = kernel_choice.read_cached(path) if path is not None else None
    return data if isinstance(data, dict) else {}
