"""Single stream: one request, a 64-token prompt, 128 new tokens; milliseconds per output token.

    .venv/bin/python -m benchmarks.single_stream [--dtype bfloat16] [--runs 5]
        [--weights dense|quantized] [--llama-bench PATH --gguf MODEL.gguf]

In-process engine on the default model (SmolLM2-135M). Each run times the decode steps after the
prompt's prefill (time to first token is printed apart). Runs alternate between the decode graph
(all layers of a decode step in one native call, the default) and the layer-by-layer path. Prints
one JSON line with the medians of `--runs` runs of each, and beside them the bare matmul time of
one decode token (all layers' projections and the LM head through the same prepacked linear
layers), the floor the engine's step sits on. With `--llama-bench`, llama.cpp's `llama-bench` runs
the same shape between our runs (`-p 0 -n 128 -d 64`: 128 tokens generated after 64 in the
context) on the given GGUF (make a BF16 one with `llama-quantize`; see
../shared/bench/peers/README.md). `--weights quantized` keeps the GGUF's blocks (Q4_1 for the
default model; activations in `--dtype`), as `qworker serve` does by default for such a file.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import time

import torch

from benchmarks.machine import machine_info
from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.request import Request, SamplingParams
from qworker.model.decoder import DecoderModel, load_model
from qworker.model.dtypes import resolve_dtype
from qworker.model.kernels.linear import Linear
from qworker.model.kernels.quant_linear import QuantLinear
from qworker.model.loading.hub import resolve_model
from qworker.model.tokenizer.tokenizer import Tokenizer

PROMPT_TOKENS, NEW_TOKENS = 64, 128


def one_run(engine: Engine, prompt: list[int], run: int, graph: bool) -> tuple[float, float]:
    """(time to first token, mean seconds per later token)."""
    model = engine.runner.model
    model.decode_graph.enabled = graph
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, ignore_eos=True,
                            temperature=0.0)
    engine.add(Request(f"single-{run}-{graph}", prompt, params))
    started = time.perf_counter()
    stamps = []
    while engine.has_unfinished():
        if any(o.new_token_ids for o in engine.step()):
            stamps.append(time.perf_counter())
    assert len(stamps) == NEW_TOKENS
    return stamps[0] - started, (stamps[-1] - stamps[0]) / (NEW_TOKENS - 1)


def bare_matmul_seconds(model: DecoderModel, repeats: int = 20) -> float:
    """One token through every linear layer (inputs of the right widths, no attention)."""
    layers = [m for m in model.modules() if isinstance(m, Linear | QuantLinear)]
    inputs = {m: torch.randn(1, m.in_features, dtype=model.dtype) for m in layers}
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            started = time.perf_counter()
            for m in layers:
                m(inputs[m])
            times.append(time.perf_counter() - started)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--weights", default="dense", choices=("dense", "quantized"),
                        help="quantized: a GGUF's blocks kept (native quantized kernels)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--llama-bench", help="llama.cpp's llama-bench binary, to run beside")
    parser.add_argument("--gguf", help="the model for llama-bench (a BF16 GGUF)")
    args = parser.parse_args()
    if args.llama_bench and not args.gguf:
        parser.error("--llama-bench needs --gguf")
    torch.set_num_threads(args.threads)
    path = str(resolve_model(args.model))
    model = load_model(path, dtype=resolve_dtype(args.dtype, "cpu"), weights=args.weights)
    engine = Engine(model, Tokenizer.load(path), EngineConfig(max_num_seqs=1, kv_cache_gb=0.25,
                                                                 prefix_caching=False))
    engine.warm_up()
    model.release_weights()
    rng = random.Random(0)
    prompt = [rng.randrange(32, model.config.vocab_size) for _ in range(PROMPT_TOKENS)]
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    llama_ms = []
    for i in range(args.runs):  # interleaved, so that a noisy spell hits every engine alike
        for graph in (True, False):
            runs[graph].append(one_run(engine, prompt, i, graph))
        if args.llama_bench:
            llama_ms.append(llama_bench_ms_per_token(args.llama_bench, args.gguf, args.threads))
    ms = {graph: statistics.median(r[1] for r in runs[graph]) * 1000 for graph in runs}
    figures = {
        "dtype": args.dtype, "weights": model.weights_kept(),
        "weight_mb": round(model.weight_bytes() / 2**20, 1), "threads": args.threads,
        "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": NEW_TOKENS, "runs": args.runs, **machine_info(),
        "kernels": model.kernel_report(), "ms_per_token": round(ms[True], 2),
        "layer_by_layer_ms_per_token": round(ms[False], 2),
        "ttft_ms": round(statistics.median(r[0] for r in runs[True]) * 1000, 1),
        "bare_matmul_ms_per_token": round(bare_matmul_seconds(model) * 1000, 2),
    }
    if llama_ms:
        figures |= {"llama_cpp_ms_per_token": round(statistics.median(llama_ms), 2),
                    "llama_cpp_over_ours": round(statistics.median(llama_ms) / ms[True], 3)}
    print(json.dumps(figures), flush=True)


def llama_bench_ms_per_token(binary: str, gguf: str, threads: int) -> float:
    """ms per generated token of llama.cpp on the same shape (one run)."""
    command = [binary, "-m", gguf, "-t", str(threads), "-p", "0", "-n", str(NEW_TOKENS),
               "-d", str(PROMPT_TOKENS), "-r", "1", "-o", "json"]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    [result] = json.loads(out)
    return 1000 / statistics.median(result["samples_ts"])


if __name__ == "__main__":
    main()
