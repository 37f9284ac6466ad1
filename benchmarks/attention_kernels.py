"""The paged-attention kernels at long contexts: prefill chunks after a cached prefix (native flash
kernel against the torch path's SDPA with an offset mask) and decodes sharing that prefix.

    .venv/bin/python -m benchmarks.attention_kernels [--dtype float32] [--threads 1] \
        [--cached 0 1024] [--chunks 16 136 512] [--decodes 16 64]

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head size 64, 128-token blocks), random
K/V. Prints one JSON line per case: median milliseconds of one layer's call over `--reps` calls,
the largest difference from the torch path, and GFLOP/s (4 flops per query head, key and dim).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.machine import machine_info
from qworker.model.kernels import native
from qworker.model.layers.paged_attention import _prefill

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 128


def timed(call: Callable[[], object], reps: int) -> float:
    call()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def prefill_case(cache: tuple[torch.Tensor, torch.Tensor], cached: int, num: int,
                 reps: int) -> dict[str, object]:
    cache_k, cache_v = cache
    dtype, num_blocks = cache_k.dtype, cache_k.shape[1]
    total = cached + num
    table = torch.randperm(num_blocks)[: -(-total // BLOCK)]
    rows = (torch.arange(KV_HEADS)[:, None] * num_blocks + table[None]).flatten()
    q = torch.randn(num, HEADS, HEAD_DIM).to(dtype)
    visible = torch.arange(total)[None] <= torch.arange(cached, total)[:, None]
    mask = visible.repeat(HEADS // KV_HEADS, 1)[None, None]
    scale = HEAD_DIM**-0.5
    ours = native.prefill_attention(q, cache_k, cache_v, table, cached, scale)
    torch_path = _prefill(q, cache_k, cache_v, rows, mask, cached, scale)
    flops = 4 * HEADS * HEAD_DIM * sum(cached + i + 1 for i in range(num))
    native_ms = timed(lambda: native.prefill_attention(q, cache_k, cache_v, table, cached, scale),
                      reps)
    sdpa_ms = timed(lambda: _prefill(q, cache_k, cache_v, rows, mask, cached, scale), reps)
    return {"case": "prefill", "cached": cached, "chunk": num, "native_ms": round(native_ms, 3),
            "sdpa_ms": round(sdpa_ms, 3), "native_gflops": round(flops / native_ms / 1e6, 1),
            "max_abs_diff": float((ours.float() - torch_path.float()).abs().max())}


def decode_case(dtype: torch.dtype, prefix: int, seqs: int, reps: int) -> dict[str, object]:
    """`seqs` decodes sharing `prefix` tokens, each with up to 2 blocks of its own after it."""
    shared = -(-prefix // BLOCK)
    cache_k = torch.randn(KV_HEADS, shared + 2 * seqs, BLOCK, HEAD_DIM).to(dtype)
    cache_v = torch.randn_like(cache_k)
    lens = torch.randint(prefix + 16, prefix + 2 * BLOCK, (seqs,))
    tables = torch.stack([torch.cat([torch.arange(shared), shared + 2 * s + torch.arange(2)])
                          for s in range(seqs)])
    q = torch.randn(seqs, HEADS, HEAD_DIM).to(dtype)
    scale = HEAD_DIM**-0.5
    ms = timed(lambda: native.decode_attention(q, cache_k, cache_v, tables, lens, scale), reps)
    flops = 4 * HEADS * HEAD_DIM * float(lens.sum())
    return {"case": "decode", "shared_prefix": prefix, "seqs": seqs, "native_ms": round(ms, 3),
            "native_gflops": round(flops / ms / 1e6, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cached", type=int, nargs="+", default=[0, 1024])
    parser.add_argument("--chunks", type=int, nargs="+", default=[16, 136, 512])
    parser.add_argument("--decodes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    assert native.library() is not None, "no native kernels here: nothing to measure"
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    common = {"benchmark": "attention_kernels", "dtype": args.dtype, "threads": args.threads,
              **machine_info()}
    longest = max(args.cached) + max(args.chunks)
    cache = (torch.randn(KV_HEADS, -(-longest // BLOCK) + 4, BLOCK, HEAD_DIM).to(dtype),
             torch.randn(KV_HEADS, -(-longest // BLOCK) + 4, BLOCK, HEAD_DIM).to(dtype))
    for cached in args.cached:
        for num in args.chunks:
            print(json.dumps({**common, **prefill_case(cache, cached, num, args.reps)}),
                  flush=True)
    for seqs in args.decodes:
        print(json.dumps({**common, **decode_case(dtype, max(args.cached), seqs, args.reps)}),
              flush=True)


if __name__ == "__main__":
    main()
