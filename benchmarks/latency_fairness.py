"""Latency fairness: while 32 sequences decode, a 4,096-token prompt arrives; with chunked prefill
the running sequences' inter-token latency (ITL) p99 stays within 3x its median.

    .venv/bin/python -m benchmarks.latency_fairness [--quick] [--tail 16] [--chunk 512]
        [--stretch 2.0]

In-process engine on the default model (SmolLM2-135M) in the `auto` CPU dtype (bfloat16 where the
CPU has AVX512-BF16 / AMX), run three times in one process: "paced" (prefill_chunk =
max_batched_tokens = 512, and `decode_stretch` set: prefill beside decodes is paced so such a step
takes about `--stretch` times a decode-only step), "chunked" (the same chunks, no pacing) and
"unchunked" (4096 tokens at once). 32 requests with short prompts start decoding (ignore_eos); a
few steps later one request with a 4,096-token prompt of random ids arrives. Every `engine.step()`
is timed; a decoding sequence's ITL samples are the durations of the steps in which it got a token.

The window measured runs from the arrival of the long prompt until its first token plus `--tail`
decode-only steps (16 by default: more than the 8 steps a chunked 4,096-token prefill takes, so the
window's median is a plain decode step in both configurations and p99 is the worst stall). The
decode-only steps before the arrival give `baseline_itl_ms_p50`, and `ratio_p99_baseline_p50`
compares the window's p99 with it (when pacing, most of the window is paced steps, and then the
window's own median is a paced step, not a plain decode). `within_3x` holds the stricter of the two
ratios to 3.

`--threads` sets torch's threads (default: torch's own). On a shared machine other users' load
stretches steps unevenly (torch's threads wait for each other in every op), so each line also
prints the 1-minute load average.

Prints one JSON line per configuration: dtype, ITL p50 / p99 / max (ms) over the window, ratio
p99 / p50, whether that is within 3x, the long prompt's TTFT, and the counts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from benchmarks.machine import machine_info
from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.request import Request, SamplingParams
from qworker.model.decoder import DecoderModel, load_model
from qworker.model.dtypes import resolve_dtype
from qworker.model.loading.hub import resolve_model
from qworker.model.tokenizer.tokenizer import Tokenizer

LONG_ID = "long"


@dataclass(frozen=True)
class Scenario:
    decoders: int = 32
    short_prompt: int = 16
    long_prompt: int = 4096
    settle_steps: int = 4  # decode-only steps before the long prompt arrives
    tail_steps: int = 16  # steps measured after the long prompt's first token


@dataclass
class Trace:
    """Per-step durations and, per decoding sequence, the steps in which it got a token."""

    durations: list[float] = field(default_factory=list)
    got_token: list[set[str]] = field(default_factory=list)


def percentile(values: list[float], q: int) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def timed_step(engine: Engine, trace: Trace) -> set[str]:
    started = time.perf_counter()
    outputs = engine.step()
    trace.durations.append(time.perf_counter() - started)
    ids = {o.request_id for o in outputs if o.new_token_ids}
    trace.got_token.append(ids)
    return ids


def add_decoders(engine: Engine, scenario: Scenario, vocab: int) -> list[str]:
    rng = random.Random(1)
    steps = scenario.settle_steps + scenario.tail_steps + scenario.long_prompt + 64  # never ends
    params = SamplingParams(max_tokens=steps, ignore_eos=True, temperature=0.0)
    ids = [f"d{i}" for i in range(scenario.decoders)]
    for rid in ids:
        prompt = [rng.randrange(32, vocab) for _ in range(scenario.short_prompt)]
        engine.add(Request(rid, prompt, params))
    return ids


def warm_up(engine: Engine, vocab: int) -> None:
    """A short run so that first-call costs (allocations, kernel selection) stay out of the
    measurement."""
    rng = random.Random(2)
    prompt = [rng.randrange(32, vocab) for _ in range(engine.config.prefill_chunk)]
    engine.generate([prompt, prompt[:16]], SamplingParams(max_tokens=4, ignore_eos=True))


def run_config(model: DecoderModel, tokenizer: Tokenizer, name: str, chunk: int,
               stretch: float | None, scenario: Scenario) -> dict[str, object]:
    config = EngineConfig(max_num_seqs=scenario.decoders + 1, prefill_chunk=chunk,
                          max_batched_tokens=chunk, kv_cache_gb=0.5, decode_stretch=stretch,
                          max_model_len=scenario.long_prompt + 512)
    engine = Engine(model, tokenizer, config)
    engine.prepare()  # the measured kernel choice and the rest, as `qworker serve` starts
    vocab = model.config.vocab_size
    warm_up(engine, vocab)
    decoders = set(add_decoders(engine, scenario, vocab))
    before, window = Trace(), Trace()
    first: set[str] = set()
    while first != decoders or len(before.durations) < scenario.settle_steps:
        first |= timed_step(engine, before)  # prefill of the short prompts, then decodes
    long_rng = random.Random(0)
    long_prompt = [long_rng.randrange(32, vocab) for _ in range(scenario.long_prompt)]
    arrived = time.perf_counter()
    engine.add(Request(LONG_ID, long_prompt, SamplingParams(
        max_tokens=scenario.tail_steps + 4, ignore_eos=True, temperature=0.0)))
    ttft, prefill_steps, tail = None, 0, 0
    while tail < scenario.tail_steps:
        got = timed_step(engine, window)
        if ttft is None:
            prefill_steps += 1
            if LONG_ID in got:
                ttft = time.perf_counter() - arrived
        else:
            tail += 1
    return summarize(name, chunk, stretch, engine, scenario, before, window, decoders, ttft,
                     prefill_steps)


def itl_samples(trace: Trace, decoders: set[str]) -> list[float]:
    return [d * 1000 for d, ids in zip(trace.durations, trace.got_token, strict=True)
            for _ in ids & decoders]


def summarize(name: str, chunk: int, stretch: float | None, engine: Engine,
              scenario: Scenario, before: Trace, window: Trace, decoders: set[str],
              ttft: float | None, prefill_steps: int) -> dict[str, object]:
    itl = itl_samples(window, decoders)
    baseline = itl_samples(Trace(before.durations[-scenario.settle_steps:],
                                 before.got_token[-scenario.settle_steps:]), decoders)
    p50, p99 = percentile(itl, 50), percentile(itl, 99)
    baseline_p50 = percentile(baseline, 50)
    stalled = len(window.durations) * len(decoders) - len(itl)
    return {
        "config": name, "prefill_chunk": chunk, "max_batched_tokens": chunk,
        "decode_stretch": stretch,
        "dtype": str(engine.runner.model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "decoding_seqs": len(decoders), "long_prompt_tokens": scenario.long_prompt,
        "window": f"from the long prompt's arrival to its first token + {scenario.tail_steps} "
                  "steps",
        "window_steps": len(window.durations), "long_prefill_steps": prefill_steps,
        "itl_samples": len(itl), "missed_decode_slots": stalled,
        "itl_ms_p50": round(p50, 1), "itl_ms_p99": round(p99, 1),
        "itl_ms_max": round(max(itl), 1), "ratio_p99_p50": round(p99 / p50, 2),
        "within_3x": p99 <= 3 * min(p50, baseline_p50),
        "baseline_itl_ms_p50": round(baseline_p50, 1),
        "ratio_p99_baseline_p50": round(p99 / baseline_p50, 2),
        "long_ttft_ms": round((ttft or float("nan")) * 1000, 1),
        "preemptions": engine.num_preemptions,
        "loadavg_1m": round(os.getloadavg()[0], 2),  # a shared machine: other users' load
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--tail", type=int, default=16, help="steps measured after the first token")
    parser.add_argument("--chunk", type=int, help="prefill chunk of the chunked configuration "
                        "(default 512; 256 with --quick)")
    parser.add_argument("--stretch", type=float, default=2.0,
                        help="decode_stretch of the paced configuration")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 8 decoders, a 1,024-token prompt, chunks of 256")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = str(resolve_model(args.model))
    dtype = resolve_dtype(args.dtype, "cpu")
    model = load_model(path, dtype=dtype)
    tokenizer = Tokenizer.load(path)
    if args.quick:
        scenario = Scenario(decoders=8, long_prompt=1024, tail_steps=args.tail)
        chunk, whole = args.chunk or 256, 1024
    else:
        scenario = Scenario(tail_steps=args.tail)
        chunk, whole = args.chunk or 512, 4096
    configs = (("paced", chunk, args.stretch), ("chunked", chunk, None),
               ("unchunked", whole, None))
    with torch.inference_mode():
        for name, size, stretch in configs:
            result = run_config(model, tokenizer, name, size, stretch, scenario)
            print(json.dumps({**result, **machine_info()}), flush=True)
            gc.collect()  # the previous engine's KV cache goes before the next one's


if __name__ == "__main__":
    main()
