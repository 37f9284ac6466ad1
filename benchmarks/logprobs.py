"""The cost of logprobs: workload v1 with `logprobs=K` on every job beside the same jobs without,
one engine, the same run, rounds in alternating order (issue 16, target 3: under 5%).

    .venv/bin/python -m benchmarks.logprobs [--logprobs 5] [--count 64] [--rounds 3]
        [--dtype float32]

Prints one JSON line: useful output tokens/s of each run, the median ratio with / without over
the rounds, the share of each with-logprobs run's wall time spent computing them (a figure the
machine's noise moves less than the ratio), and the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from benchmarks.machine import machine_info
from benchmarks.workload import WorkItem, fingerprint, standard_workload
from qworker.engine import runner as runner_module
from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.request import Request, SamplingParams
from qworker.model.decoder import load_model
from qworker.model.dtypes import resolve_dtype
from qworker.model.loading.hub import resolve_model
from qworker.model.tokenizer.tokenizer import Tokenizer


class Timed:
    """Wraps the runner's token_logprobs, adding up the time spent in it."""

    def __init__(self) -> None:
        self.inner = getattr(runner_module, "token_logprobs")  # noqa: B009
        self.seconds = 0.0
        setattr(runner_module, "token_logprobs", self)  # noqa: B010 (a module attribute)

    def __call__(self, *args: Any) -> Any:
        started = time.perf_counter()
        try:
            return self.inner(*args)
        finally:
            self.seconds += time.perf_counter() - started


def run(engine: Engine, items: list[WorkItem], logprobs: int | None, tag: str) -> float:
    """Useful output tokens/s of the whole workload, every job asking `logprobs`."""
    for i, item in enumerate(items):
        params = SamplingParams(max_tokens=item.output_len, min_tokens=item.output_len,
                                ignore_eos=True, temperature=0.0, logprobs=logprobs)
        engine.add(Request(f"{tag}{i}", item.prompt_ids, params))
    produced, entries = 0, 0
    started = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            produced += len(out.new_token_ids)
            entries += len(out.logprobs or ())
    wall = time.perf_counter() - started
    useful = sum(item.output_len for item in items)
    assert produced == useful, f"generated {produced} tokens, the workload asks for {useful}"
    assert entries == (useful if logprobs is not None else 0), "a token without its logprobs"
    return useful / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--logprobs", type=int, default=5)
    parser.add_argument("--count", type=int, default=64, help="jobs of workload v1 (64: all)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kv-cache-gb", type=float, default=2.0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    items = standard_workload(seed=0)[: args.count]
    path = str(resolve_model(args.model))
    model = load_model(path, dtype=resolve_dtype(args.dtype, "cpu"))
    engine = Engine(model, Tokenizer.load(path),
                    EngineConfig(max_num_seqs=args.max_num_seqs, kv_cache_gb=args.kv_cache_gb,
                                 prefix_caching=False))
    engine.warm_up()
    engine.generate([items[0].prompt_ids], SamplingParams(max_tokens=4, ignore_eos=True,
                                                          logprobs=args.logprobs))
    timed = Timed()
    plain, asking, ratios, shares = [], [], [], []
    for r in range(args.rounds):  # alternating order: a neighbour's load falls on both alike
        order = [None, args.logprobs] if r % 2 == 0 else [args.logprobs, None]
        got = {}
        for k in order:
            timed.seconds, started = 0.0, time.perf_counter()
            got[k] = run(engine, items, k, f"r{r}k{k}-")
            if k is not None:
                shares.append(timed.seconds / (time.perf_counter() - started))
        plain.append(got[None])
        asking.append(got[args.logprobs])
        ratios.append(got[args.logprobs] / got[None])
    print(json.dumps({
        "benchmark": "logprobs", "workload": "v1", "jobs": len(items),
        "fingerprint": fingerprint(items), "dtype": args.dtype, "logprobs": args.logprobs,
        "threads": args.threads, "rounds": args.rounds,
        "useful_out_tok_s_without": [round(v, 1) for v in plain],
        "useful_out_tok_s_with": [round(v, 1) for v in asking],
        "ratio_with_over_without_median": round(statistics.median(ratios), 4),
        "cost_pct_median": round(100 * (1 - statistics.median(ratios)), 2),
        "logprobs_share_of_wall_pct": [round(100 * v, 2) for v in shares],
        **machine_info(),
    }), flush=True)


if __name__ == "__main__":
    main()
