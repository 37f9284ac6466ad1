"""Engine throughput on standard workload v1, in-process, beside transformers' static batching.

    .venv/bin/python -m benchmarks.engine_throughput [--dtype bfloat16 float32] [--no-baseline]
        [--weights dense quantized auto] [--speculate-tokens 0 4]

Prints one JSON line per (engine, dtype): useful output tokens/s (each request counts exactly
the tokens it asked for), total tokens/s, steps, mean batch size, preemptions, and the share of
wall time spent outside the model forward.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch

from benchmarks.machine import machine_info
from benchmarks.workload import WorkItem, fingerprint, standard_workload
from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.request import Request, SamplingParams
from qworker.model.decoder import load_model
from qworker.model.dtypes import resolve_dtype
from qworker.model.loading.hub import resolve_model
from qworker.model.tokenizer.tokenizer import Tokenizer


def run_qworker(model_path: str, dtype: torch.dtype, items: list[WorkItem],
                config: EngineConfig, weights: str = "dense") -> dict[str, object]:
    model = load_model(model_path, dtype=dtype, weights=weights)
    engine = Engine(model, Tokenizer.load(model_path), config)
    engine.prepare()  # the measured kernel choice and the rest, as Engine.from_config does
    engine.generate([items[0].prompt_ids], SamplingParams(max_tokens=4, ignore_eos=True))  # warm
    return {"engine": "qworker", "weights": model.weights_kept(), **run_engine(engine, items)}


def run_engine(engine: Engine, items: list[WorkItem]) -> dict[str, object]:
    """The workload on a warm, empty engine, every request added before the clock starts."""
    engine.runner.forward_seconds, engine.num_steps, engine.num_preemptions = 0.0, 0, 0
    for i, item in enumerate(items):
        params = SamplingParams(max_tokens=item.output_len, min_tokens=item.output_len,
                                ignore_eos=True, temperature=0.0)
        engine.add(Request(f"w{i}", item.prompt_ids, params))
    produced, batch_sizes = 0, []
    started = time.perf_counter()
    while engine.has_unfinished():
        outputs = engine.step()
        produced += sum(len(o.new_token_ids) for o in outputs)
        batch_sizes.append(len(engine.last_schedule.work))
    wall = time.perf_counter() - started
    useful = sum(item.output_len for item in items)
    assert produced == useful, f"generated {produced} tokens, the workload asks for {useful}"
    return {
        "useful_out_tok_s": round(useful / wall, 1),
        "total_tok_s": round((useful + sum(len(i.prompt_ids) for i in items)) / wall, 1),
        "wall_s": round(wall, 2),
        "steps": engine.num_steps,
        "mean_batch_size": round(sum(batch_sizes) / max(1, len(batch_sizes)), 1),
        "preemptions": engine.num_preemptions,
        "outside_forward_share": round(1 - engine.runner.forward_seconds / wall, 3),
    }


def run_transformers(model_path: str, dtype: torch.dtype, items: list[WorkItem],
                     batch: int = 16) -> dict[str, object]:
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    pad = 0
    started = time.perf_counter()
    for start in range(0, len(items), batch):
        group = items[start : start + batch]
        width = max(len(i.prompt_ids) for i in group)
        ids = torch.tensor([[pad] * (width - len(i.prompt_ids)) + i.prompt_ids for i in group])
        mask = torch.tensor([[0] * (width - len(i.prompt_ids)) + [1] * len(i.prompt_ids)
                             for i in group])
        new = max(i.output_len for i in group)
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                        min_new_tokens=new, do_sample=False, pad_token_id=pad)
    wall = time.perf_counter() - started
    useful = sum(item.output_len for item in items)
    return {"engine": f"transformers-static-{batch}", "useful_out_tok_s": round(useful / wall, 1),
            "total_tok_s": round((useful + sum(len(i.prompt_ids) for i in items)) / wall, 1),
            "wall_s": round(wall, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--weights", nargs="+", default=["dense"],
                        choices=("dense", "quantized", "auto"),
                        help="quantized: the GGUF's blocks kept (native quantized kernels); auto: "
                             "as `qworker serve` chooses (weights_auto.py)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--kv-cache-gb", type=float, default=2.0)
    parser.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    parser.add_argument("--speculate-tokens", type=int, nargs="+", default=[0],
                        help="speculative decoding's draft length; several: one run each, "
                             "alternating (0: off)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    items = standard_workload(seed=0)
    path = str(resolve_model(args.model))
    config = EngineConfig(max_num_seqs=args.max_num_seqs, kv_cache_gb=args.kv_cache_gb,
                          max_batched_tokens=args.max_batched_tokens,
                          prefill_chunk=args.prefill_chunk, block_size=args.block_size)
    for name in args.dtype:
        dtype = resolve_dtype(name, "cpu")
        common = {"dtype": name, "workload": "v1", "fingerprint": fingerprint(items),
                  "threads": args.threads, **machine_info()}
        for weights in args.weights:
            for k in args.speculate_tokens:
                ours = run_qworker(path, dtype, items, replace(config, num_speculative_tokens=k),
                                   weights)
                print(json.dumps({**common, "speculate_tokens": k, **ours}), flush=True)
        if not args.no_baseline:
            base = run_transformers(path, dtype, items)
            ratio = ours["useful_out_tok_s"] / base["useful_out_tok_s"]  # type: ignore[operator]
            print(json.dumps({**common, **base, "qworker_speedup": round(ratio, 2)}), flush=True)


if __name__ == "__main__":
    main()
