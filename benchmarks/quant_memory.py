"""Memory of a 7B-class model kept quantized: a Llama-2-7B-shaped GGUF of random Q4_0 (or Q8_0)
blocks is written, loaded as `qworker serve` loads it, and the process's RSS after load is set
against the file's size plus the KV cache (target: at most 1.25x the file + the cache).

    .venv/bin/python -m benchmarks.quant_memory [--type Q4_0] [--dir /tmp] [--keep]
        [--layers 32] [--decode-tokens 8] [--llama-bench PATH]

The file (3.8 GB for Q4_0, 7.2 GB for Q8_0) is deleted afterwards unless --keep. Single-stream
ms per token (a few decode steps after a 16-token prompt) follows on a second JSON line, with
llama.cpp's `llama-bench` on the same file beside it when given (or why it failed).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import time
from pathlib import Path

import gguf
import numpy as np
import torch

from benchmarks.machine import machine_info
from qworker.model.batch import SequenceInput, build_batch
from qworker.model.decoder import load_model
from qworker.model.kv_cache import KVCache

LLAMA2_7B = dict(vocab=32000, hidden=4096, inter=11008, heads=32, kv_heads=32, context=4096)
SCALE_OFFSETS = {"Q4_0": 0, "Q8_0": 0}  # where a block's f16 scale sits


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def random_blocks(kind: gguf.GGMLQuantizationType, rows: int, cols: int,
                  rng: np.random.Generator) -> np.ndarray:
    elems, nbytes = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(rows, cols // elems, nbytes), dtype=np.uint8)
    scale = rng.uniform(0.001, 0.004, size=raw.shape[:2]).astype(np.float16)
    at = SCALE_OFFSETS[kind.name]
    raw[..., at : at + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def write_model(path: Path, kind: gguf.GGMLQuantizationType, layers: int) -> None:
    """Tensor by tensor (the writer never holds the whole model)."""
    s, rng = LLAMA2_7B, np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(s["context"])
    writer.add_embedding_length(s["hidden"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(s["inter"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    # a placeholder byte-level BPE vocabulary, as llama.cpp loads one: its newline token ("Ċ")
    # and at least one merge
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["Ċ", *(f"t{i}" for i in range(1, s["vocab"]))])
    writer.add_token_merges(["t 1"])
    matrices = {"token_embd.weight": (s["vocab"], s["hidden"]),
                "output.weight": (s["vocab"], s["hidden"])}
    for i in range(layers):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            matrices[f"blk.{i}.{part}.weight"] = (s["hidden"], s["hidden"])
        matrices[f"blk.{i}.ffn_gate.weight"] = (s["inter"], s["hidden"])
        matrices[f"blk.{i}.ffn_up.weight"] = (s["inter"], s["hidden"])
        matrices[f"blk.{i}.ffn_down.weight"] = (s["hidden"], s["inter"])
    norms = [f"blk.{i}.{n}.weight" for i in range(layers) for n in ("attn_norm", "ffn_norm")]
    norms.append("output_norm.weight")
    elems, nbytes = gguf.GGML_QUANT_SIZES[kind]
    for name, (rows, cols) in matrices.items():
        shape = (rows, cols // elems * nbytes)
        writer.add_tensor_info(name, shape, np.dtype(np.uint8), rows * shape[1], raw_dtype=kind)
    for name in norms:
        writer.add_tensor_info(name, (s["hidden"],), np.dtype(np.float32), 4 * s["hidden"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for rows, cols in matrices.values():
        writer.write_tensor_data(random_blocks(kind, rows, cols, rng))
    for _ in norms:
        writer.write_tensor_data(np.ones(s["hidden"], np.float32))
    writer.close()


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
    parser.add_argument("--type", default="Q4_0", choices=tuple(SCALE_OFFSETS))
    parser.add_argument("--dir", default="/tmp")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=8)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--llama-bench")
    args = parser.parse_args()
    kind = gguf.GGMLQuantizationType[args.type]
    path = Path(args.dir) / f"qworker-7b-shaped-{args.type}-{args.layers}.gguf"
    try:
        if not path.exists():
            write_model(path, kind, args.layers)
        before = rss_bytes()
        model = load_model(path, dtype=torch.float32, weights="quantized")
        model.choose_kernels(1, 1)
        context = 256
        cache = KVCache.allocate(model.config, -(-context // 128), 128, torch.float32, "cpu")
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # heap freed during load, back to the system
        rss = rss_bytes()
        kv = sum(t.numel() * t.element_size() for t in (*cache.keys, *cache.values))
        file_bytes = path.stat().st_size
        figures = {
            "type": args.type, "layers": args.layers, **machine_info(),
            "file_gb": round(file_bytes / 1e9, 3), "kv_cache_gb": round(kv / 1e9, 3),
            "rss_before_load_gb": round(before / 1e9, 3), "rss_after_load_gb": round(rss / 1e9, 3),
            "weight_gb": round(model.weight_bytes() / 1e9, 3),
            "rss_over_file_plus_kv": round(rss / (file_bytes + kv), 3),
            "kernels": model.kernel_report(),
        }
        print(json.dumps(figures), flush=True)  # the memory figures, before the slow part
        figures = {"ms_per_token": round(decode_ms(model, cache, 16, args.decode_tokens), 1)}
        if args.llama_bench:
            figures["llama_cpp_ms_per_token"] = llama_bench_ms(
                args.llama_bench, path, torch.get_num_threads(), args.decode_tokens)
        print(json.dumps(figures), flush=True)
    finally:
        if not args.keep:
            path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
