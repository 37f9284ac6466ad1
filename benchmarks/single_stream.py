"""Single stream: one request, a 64-token prompt, 128 new tokens; milliseconds per output token.

    .venv/bin/python -m benchmarks.single_stream [--dtype bfloat16] [--runs 5]

In-process engine on the default model (SmolLM2-135M). Each run times the decode steps after the
prompt's prefill (time to first token is printed apart). Prints one JSON line with the median of
`--runs` runs, and beside it the bare matmul time of one decode token (all layers' projections and
the LM head through the same prepacked linear layers), the floor the engine's step sits on.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.request import Request, SamplingParams
from qworker.model.dtypes import resolve_dtype
from qworker.model.hub import resolve_model
from qworker.model.linear import Linear
from qworker.model.llama import LlamaModel, load_model
from qworker.model.tokenizer import Tokenizer

PROMPT_TOKENS, NEW_TOKENS = 64, 128


def one_run(engine: Engine, prompt: list[int], run: int) -> tuple[float, float]:
    """(time to first token, mean seconds per later token)."""
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, ignore_eos=True,
                            temperature=0.0)
    engine.add(Request(f"single-{run}", prompt, params))
    started = time.perf_counter()
    stamps = []
    while engine.has_unfinished():
        if any(o.new_token_ids for o in engine.step()):
            stamps.append(time.perf_counter())
    assert len(stamps) == NEW_TOKENS
    return stamps[0] - started, (stamps[-1] - stamps[0]) / (NEW_TOKENS - 1)


def bare_matmul_seconds(model: LlamaModel, repeats: int = 20) -> float:
    """One token through every linear layer (inputs of the right widths, no attention)."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
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
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = str(resolve_model(args.model))
    model = load_model(path, dtype=resolve_dtype(args.dtype, "cpu"))
    engine = Engine(model, Tokenizer.load(path), EngineConfig(max_num_seqs=1, kv_cache_gb=0.25))
    engine.runner.warm_up()
    rng = random.Random(0)
    prompt = [rng.randrange(32, model.config.vocab_size) for _ in range(PROMPT_TOKENS)]
    runs = [one_run(engine, prompt, i) for i in range(args.runs)]
    print(json.dumps({
        "dtype": args.dtype, "threads": args.threads, "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": NEW_TOKENS, "runs": args.runs,
        "ms_per_token": round(statistics.median(r[1] for r in runs) * 1000, 2),
        "ttft_ms": round(statistics.median(r[0] for r in runs) * 1000, 1),
        "bare_matmul_ms_per_token": round(bare_matmul_seconds(model) * 1000, 2),
    }), flush=True)


if __name__ == "__main__":
    main()
