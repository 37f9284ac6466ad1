"""Memory of a real-size GGUF model: a file of a real shape (benchmarks/real_shapes.py, Llama-2-7B
by default) with random blocks is written, or `--model FILE` is taken as it is, and loaded as
`qworker serve` loads it (`--weights auto` by default, its choice timed and cached in a
scratch folder), and the process's RSS after load is set against the file's size plus the KV
cache (target: at most the file + the cache + 400 MB, whatever `auto` chose).

    .venv/bin/python -m benchmarks.quant_memory [--shape llama2-7b] [--type Q4_0] [--dir /tmp]
        [--model FILE] [--weights auto|quantized] [--dtype bfloat16] [--keep] [--layers N]
        [--decode-tokens 8] [--llama-bench PATH]

A written file (3.8 GB for a 7B Q4_0, 7.2 GB for Q8_0) is deleted afterwards unless --keep.
Single-stream ms per token (a few decode steps after a 16-token prompt) follows on a second JSON
line, with llama.cpp's `llama-bench` on the same file beside it when given (or why it failed).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from benchmarks import real_shapes as rs
from benchmarks.machine import machine_info
from qworker.model.batch import SequenceInput, build_batch
from qworker.model.decoder import load_model
from qworker.model.kv_cache import KVCache


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def decode_ms(model: torch.nn.Module, cache: KVCache, prompt: int, steps: int) -> float:
    block = cache.block_size
    table = list(range(-(-(prompt + steps) // block)))
    tokens = list(range(3, 3 + prompt))
    model(build_batch([SequenceInput(tokens, 0, table, need_logits=True)], block), cache)
    times = []
    for i in range(steps):
        started = time.perf_counter()
        step = build_batch([SequenceInput([7 + i], prompt + i, table, need_logits=True)],
                           block)
        model(step, cache)
        times.append(time.perf_counter() - started)
    return 1000 * sorted(times)[len(times) // 2]


def llama_bench_ms(binary: str, path: Path, threads: int, steps: int) -> float | str:
    """ms per generated token, or why llama-bench gave none (its last line of stderr)."""
    done = subprocess.run([binary, "-m", str(path), "-t", str(threads), "-p", "0", "-n",
                           str(steps), "-d", "16", "-r", "1", "-o", "json"],
                          capture_output=True, text=True)
    if done.returncode:
        return f"failed: {(done.stderr.strip().splitlines() or [''])[-1]}"
    [result] = json.loads(done.stdout)
    return round(1000 / float(np.median(result["samples_ts"])), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama2-7b", choices=sorted(rs.SHAPES))
    parser.add_argument("--type", default="Q4_0", choices=rs.FILE_TYPES)
    parser.add_argument("--dir", type=Path, default=Path("/tmp"))
    parser.add_argument("--layers", type=int, help="fewer layers than the shape's")
    parser.add_argument("--decode-tokens", type=int, default=8)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--model", type=Path, help="an existing GGUF file (kept), not a shape")
    parser.add_argument("--weights", default="auto", choices=("auto", "quantized"))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--llama-bench")
    args = parser.parse_args()
    shape = rs.SHAPES[args.shape]
    if args.layers:
        shape = replace(shape, layers=args.layers)
    path = args.model or args.dir / f"qworker-{args.shape}-{args.type}-{shape.layers}.gguf"
    dtype = getattr(torch, args.dtype)
    try:
        if not path.exists():
            rs.write(path, shape, args.type)
        before = rss_bytes()
        with tempfile.TemporaryDirectory() as cache_dir:  # auto's timing, never a stale one
            model = load_model(path, dtype=dtype, weights=args.weights, cache_dir=Path(cache_dir))
            model.choose_kernels(1, 1)
        context = 256
        cache = KVCache.allocate(model.config, -(-context // 128), 128, dtype, "cpu")
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # heap freed during load, back to the system
        rss = rss_bytes()
        kv = sum(t.numel() * t.element_size() for t in (*cache.keys, *cache.values))
        file_bytes = path.stat().st_size
        figures = {
            "file": path.name, "weights": args.weights, "dtype": args.dtype,
            "layers": model.config.num_layers, **machine_info(),
            "file_gb": round(file_bytes / 1e9, 3), "kv_cache_gb": round(kv / 1e9, 3),
            "rss_before_load_gb": round(before / 1e9, 3), "rss_after_load_gb": round(rss / 1e9, 3),
            "weight_gb": round(model.weight_bytes() / 1e9, 3),
            "rss_over_file_plus_kv": round(rss / (file_bytes + kv), 3),
            "rss_beyond_file_plus_kv_mb": round((rss - file_bytes - kv) / 2**20),
            "kernels": model.kernel_report(),
        }
        print(json.dumps(figures), flush=True)  # the memory figures, before the slow part
        figures = {"ms_per_token": round(decode_ms(model, cache, 16, args.decode_tokens), 1)}
        if args.llama_bench:
            figures["llama_cpp_ms_per_token"] = llama_bench_ms(
                args.llama_bench, path, torch.get_num_threads(), args.decode_tokens)
        print(json.dumps(figures), flush=True)
    finally:
        if not args.keep and args.model is None:
            path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
