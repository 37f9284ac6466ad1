"""What logprobs cost a full decode step: 64 jobs of workload v1 with `logprobs=K`, all
decoding, steps alternating between the native kernel and the torch path (log_softmax of a copy
of the asked rows, then gather and topk: what the engine ran before the kernel). One process,
the same sequences, so a shared machine's load falls on both alike.

    .venv/bin/python -m benchmarks.logprobs_step [--steps 20] [--logprobs 5] [--rows 64]
        [--prompt-tokens N]

Prints one JSON line: per path the median step time, the median time in `token_logprobs` and
its median share of the step without it (the cost), and the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.machine import machine_info
from benchmarks.workload import standard_workload
from qworker.engine import runner as runner_module
from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.logprobs import token_logprobs
from qworker.engine.request import Request, SamplingParams, TokenLogprobs
from qworker.model.decoder import load_model
from qworker.model.dtypes import resolve_dtype
from qworker.model.loading.hub import resolve_model
from qworker.model.tokenizer.tokenizer import Tokenizer

PATHS = ("native_kernel", "torch_path")  # JSON keys apart from machine_info's "native"


class Timed:
    """Stands in for the runner's token_logprobs: the chosen path, timed."""

    def __init__(self) -> None:
        self.native_kernel = True
        self.seconds = 0.0

    def __call__(self, logits: torch.Tensor, rows: list[int], token_ids: list[int],
                 top: list[int]) -> list[TokenLogprobs]:
        started = time.perf_counter()
        try:
            return token_logprobs(logits, rows, token_ids, top, native_kernel=self.native_kernel)
        finally:
            self.seconds += time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--logprobs", type=int, default=5)
    parser.add_argument("--rows", type=int, default=64, help="jobs decoding together")
    parser.add_argument("--steps", type=int, default=20, help="measured steps, both paths")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="cut each prompt to its first N tokens (default: whole)")
    args = parser.parse_args()
    path = str(resolve_model(args.model))
    engine = Engine(load_model(path, dtype=resolve_dtype(args.dtype, "cpu")), Tokenizer.load(path),
                    EngineConfig(max_num_seqs=args.rows, kv_cache_gb=2.0, prefix_caching=False))
    engine.warm_up()
    tokens = args.steps + 64  # none finishes while measured
    for i, item in enumerate(standard_workload(seed=0)[: args.rows]):
        engine.add(Request(f"s{i}", item.prompt_ids[: args.prompt_tokens], SamplingParams(
            max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=0.0,
            logprobs=args.logprobs)))
    while not engine.last_schedule.work or any(n > 1 for _, n in engine.last_schedule.work):
        engine.step()  # the prefills
    timed = Timed()
    setattr(runner_module, "token_logprobs", timed)  # noqa: B010 (the runner's module global)
    walls: dict[str, list[float]] = {p: [] for p in PATHS}
    spent: dict[str, list[float]] = {p: [] for p in PATHS}
    for s in range(args.steps):
        name = PATHS[s % 2]
        timed.native_kernel, timed.seconds = name == "native_kernel", 0.0
        started = time.perf_counter()
        outs = engine.step()
        walls[name].append(time.perf_counter() - started)
        spent[name].append(timed.seconds)
        assert len(outs) == args.rows and all(o.logprobs for o in outs), "a row without logprobs"
    print(json.dumps({
        "benchmark": "logprobs_step", "rows": args.rows, "logprobs": args.logprobs,
        "dtype": args.dtype, "prompt_tokens": args.prompt_tokens, "steps_each": args.steps // 2,
        "threads": torch.get_num_threads(),
        **{name: {
            "step_ms_p50": round(1e3 * statistics.median(walls[name]), 1),
            "logprobs_ms_p50": round(1e3 * statistics.median(spent[name]), 2),
            "cost_pct_p50": round(100 * statistics.median(
                [t / (w - t) for t, w in zip(spent[name], walls[name], strict=True)]), 2),
        } for name in PATHS},
        **machine_info(),
    }), flush=True)


if __name__ == "__main__":
    main()
