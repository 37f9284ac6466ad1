"""The model forward beside the bare matmuls of the same step: how much attention, norms, rotary,
packing and Python add.

    .venv/bin/python -m benchmarks.forward_overhead [--dtype bfloat16] [--batch 32] [--context 256]

One decode step of `--batch` sequences at about `--context` tokens each (spread +-25%, shuffled
blocks) on the default model. Prints one JSON line: the forward's median time, the median time of
the same step's matmuls alone (every projection and the LM head, one row per sequence) through
`F.linear` and through the model's own repacked layers, and the ratios; and the forward once more
layer by layer (the decode graph off).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.machine import machine_info
from qworker.model.batch import SequenceInput, build_batch
from qworker.model.decoder import DecoderModel, load_model
from qworker.model.dtypes import resolve_dtype
from qworker.model.kernels.linear import Linear
from qworker.model.kv_cache import KVCache
from qworker.model.loading.hub import resolve_model

BLOCK = 16


def median_seconds(run: Callable[[], object], repeats: int = 15) -> float:
    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def decode_step(model: DecoderModel, batch: int, context: int) -> Callable[[], object]:
    rng = random.Random(0)
    lengths = [context + rng.randint(-context // 4, context // 4) for _ in range(batch)]
    need = [-(-(n + 1) // BLOCK) for n in lengths]
    blocks = list(range(1, sum(need) + 1))
    rng.shuffle(blocks)
    cache = KVCache.allocate(model.config, sum(need) + 1, BLOCK, model.dtype)
    seqs, start = [], 0
    for n, k in sorted(zip(lengths, need, strict=True), key=lambda p: p[1]):
        seqs.append(SequenceInput([rng.randrange(32, 1000)], n, blocks[start : start + k]))
        start += k
    return lambda: model(build_batch(seqs, BLOCK, "cpu"), cache)


def matmuls(model: DecoderModel, rows: int, plain: bool) -> Callable[[], object]:
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    inputs = [torch.randn(rows, m.in_features).to(model.dtype) for m in layers]

    def run() -> None:
        with torch.inference_mode():
            for layer, x in zip(layers, inputs, strict=True):
                F.linear(x, layer.weight) if plain else layer(x)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(str(resolve_model(args.model)), dtype=resolve_dtype(args.dtype, "cpu"))
    step = decode_step(model, args.batch, args.context)
    forward = median_seconds(step)
    model.decode_graph.enabled = False
    layer_by_layer = median_seconds(step)
    model.decode_graph.enabled = True
    torch_mm = median_seconds(matmuls(model, args.batch, plain=True))
    own_mm = median_seconds(matmuls(model, args.batch, plain=False))
    print(json.dumps({
        "dtype": args.dtype, "threads": args.threads, "decode_seqs": args.batch,
        "context": args.context, "forward_ms": round(forward * 1000, 1),
        "layer_by_layer_forward_ms": round(layer_by_layer * 1000, 1),
        "torch_matmuls_ms": round(torch_mm * 1000, 1), "own_matmuls_ms": round(own_mm * 1000, 1),
        "forward_over_torch_matmuls": round(forward / torch_mm, 2),
        "forward_over_own_matmuls": round(forward / own_mm, 2), **machine_info(),
    }), flush=True)


if __name__ == "__main__":
    main()
