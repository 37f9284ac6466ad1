"""What CPU taken beside the engine costs it, with no Redis at all: workload v1 in-process, quiet
and beside a side process that burns `--share` of one core in bursts of `--burst-ms`.

    .venv/bin/python -m benchmarks.side_load [--share 0.05] [--burst-ms 1.2] [--rounds 5]

`benchmarks.service_throughput` runs redis-server and the stream reader on the engine's cores; its
`redis_server_cpu_s` and `consumer_cpu_s` over `wall_s` give the share they took. A side load of the
same share says what that CPU alone costs the engine, whoever takes it. Prints one JSON line: every
pair's quiet and loaded tok/s, their ratios and the median, and the share the side process burned.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from typing import Any

import torch

from benchmarks.engine_throughput import run_engine
from benchmarks.machine import machine_info
from benchmarks.service_throughput import workload_engine
from benchmarks.workload import fingerprint, standard_workload


def burn(ready: Any, on: Any, stop: Any, burst_s: float, period_s: float, cpu_s: Any) -> None:
    """Side process: while `on` is set, spin `burst_s` once every `period_s`; adds its CPU
    seconds to `cpu_s`."""
    ready.set()
    while not stop.is_set():
        if not on.wait(0.01):
            continue
        started, cpu = time.perf_counter(), time.process_time()
        while time.perf_counter() - started < burst_s:
            pass
        cpu_s.value += time.process_time() - cpu
        time.sleep(max(0.0, period_s - (time.perf_counter() - started)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--share", type=float, default=0.05, help="of one core")
    parser.add_argument("--burst-ms", type=float, default=1.2)
    parser.add_argument("--rounds", type=int, default=5, help="pairs: quiet, then loaded")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-follow-cores", action="store_true",
                        help="the engine's threads fixed (engine/core_share.py off)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    items = standard_workload(seed=0)
    engine = workload_engine(args.model, args.dtype, follow_cores=not args.no_follow_cores)
    ctx = mp.get_context("spawn")
    ready, on, stop, cpu_s = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Value("d", 0.0)
    burst = args.burst_ms / 1000
    side = ctx.Process(target=burn, args=(ready, on, stop, burst, burst / args.share, cpu_s))
    side.start()
    ready.wait(120)  # its start (a spawned interpreter importing this module) takes CPU
    quiet, loaded, loaded_wall = [], [], 0.0
    try:
        for _ in range(args.rounds):
            quiet.append(run_engine(engine, items)["useful_out_tok_s"])
            on.set()
            run = run_engine(engine, items)
            on.clear()
            loaded.append(run["useful_out_tok_s"])
            loaded_wall += float(run["wall_s"])  # type: ignore[arg-type]
    finally:
        stop.set()
        side.join(10)
    ratios = [b / a for a, b in zip(quiet, loaded, strict=True)]
    print(json.dumps({"workload": "v1", "fingerprint": fingerprint(items), "dtype": args.dtype,
                      "side_share_of_core": round(cpu_s.value / loaded_wall, 3),
                      "side_burst_ms": args.burst_ms, "ratio": round(statistics.median(ratios), 3),
                      "ratios": [round(r, 3) for r in ratios], "quiet_runs": quiet,
                      "loaded_runs": loaded, "threads": args.threads,
                      "follow_cores": not args.no_follow_cores,
                      **machine_info()}), flush=True)


if __name__ == "__main__":
    main()
