"""Prefix caching on vs off, in-process, same model, same run (issue 16, target 1).

    .venv/bin/python -m benchmarks.prefix_cache [--requests 64 --prefix-len 1024] [--rounds 2] \
        [--vllm-model-dir /tmp/peers/smollm2-hf]

Shared-prefix workload: `--requests` requests sharing a `--prefix-len`-token prefix, each with its
own suffix of `--suffix-min`..`--suffix-max` tokens and `--output-len` output tokens, all queued
at once. Prints one JSON line per run (useful output tokens/s, TTFT p50 / p90, prefix cache hits)
and a summary with the same-run ratios: cached vs uncached throughput and TTFT p50 (target: at
most 0.2x), and on workload v1 (no shared prefixes; `--v1-requests` of it) the cost of caching
(target: under 2%), each the median over `--rounds` rounds of alternating order. `--caching on`
(or `off`) runs only that side: its JSON lines, no on / off ratios (cache off at full size is
slow); with `--caching on` the vLLM ratios below still come.

With `--vllm-model-dir`, each shared-prefix round also runs the same requests through vLLM CPU
with its prefix caching on (benchmarks.peers_vllm in vLLM's own venv, `--vllm-python`, one
subprocess per round, our dtype) and reports cached qworker's throughput over vLLM's (target: at
least 1.2x) and the TTFT p50 ratio, medians of the same-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.machine import machine_info
from benchmarks.workload import WorkItem, fingerprint, shared_prefix_workload, standard_workload
from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.request import Request, SamplingParams
from qworker.model.decoder import DecoderModel, load_model
from qworker.model.dtypes import resolve_dtype
from qworker.model.loading.hub import resolve_model
from qworker.model.tokenizer.tokenizer import Tokenizer

Peer = Callable[[], dict[str, object]]


def vllm_peer(args: argparse.Namespace, dtype: str, vocab_size: int) -> Peer:
    """Runs the shared-prefix workload through vLLM CPU, caching on; its JSON line as a dict."""
    command = [args.vllm_python, "-m", "benchmarks.peers_vllm", "--model-dir",
               args.vllm_model_dir, "--dtype", dtype, "--workload", "shared-prefix",
               "--requests", str(args.requests), "--prefix-len", str(args.prefix_len),
               "--suffix-min", str(args.suffix_min), "--suffix-max", str(args.suffix_max),
               "--output-len", str(args.output_len), "--seed", str(args.seed),
               "--vocab-size", str(vocab_size)]

    env = dict(os.environ, VLLM_LOGGING_STREAM="ext://sys.stderr")  # stdout: its JSON line

    def peer() -> dict[str, object]:
        done = subprocess.run(command, cwd=Path(__file__).resolve().parent.parent, env=env,
                              check=True, stdout=subprocess.PIPE, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        return dict(json.loads(lines[-1]))
    return peer


def run(model: DecoderModel, tokenizer: Tokenizer, config: EngineConfig,
        items: list[WorkItem]) -> dict[str, object]:
    engine = Engine(model, tokenizer, config)
    engine.warm_up()  # the kernel choice (cached after the first engine)
    engine.generate([[7] * 8], SamplingParams(max_tokens=2, ignore_eos=True))  # first-call costs
    engine.blocks.drop_cache()  # nothing of the warm-up helps the measured requests
    engine.num_preemptions = 0
    base = engine.stats().get("prefix_cache_hits", 0)
    for i, item in enumerate(items):
        params = SamplingParams(max_tokens=item.output_len, min_tokens=item.output_len,
                                ignore_eos=True, temperature=0.0)
        engine.add(Request(f"r{i}", item.prompt_ids, params))
    first: dict[str, float] = {}
    produced = 0
    started = time.perf_counter()
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter() - started
        for out in outputs:
            produced += len(out.new_token_ids)
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
    wall = time.perf_counter() - started
    useful = sum(item.output_len for item in items)
    assert produced == useful, f"generated {produced} tokens, the workload asks for {useful}"
    ttfts = sorted(first.values())
    stats = engine.stats()
    return {
        "prefix_caching": config.prefix_caching,
        "useful_out_tok_s": round(useful / wall, 1),
        "wall_s": round(wall, 2),
        "ttft_p50_s": round(statistics.median(ttfts), 3),
        "ttft_p90_s": round(ttfts[int(0.9 * (len(ttfts) - 1))], 3),
        "prefix_cache_hit_tokens": stats.get("prefix_cache_hits", 0) - base,
        "prompt_tokens": sum(len(item.prompt_ids) for item in items),
        "preemptions": engine.num_preemptions,
    }


def ratio(a: dict[str, object], b: dict[str, object], key: str) -> float:
    return float(a[key]) / float(b[key])  # type: ignore[arg-type]


def compare(name: str, model: DecoderModel, tokenizer: Tokenizer, config: EngineConfig,
            items: list[WorkItem], rounds: int, common: dict[str, object],
            modes: tuple[bool, ...] = (False, True), peer: Peer | None = None
            ) -> dict[str, float]:
    """Runs off and on (those of `modes`) `rounds` times, alternating which goes first, then
    `peer` if any (after a cache-on run); median same-round ratios."""
    throughput, ttft, peer_throughput, peer_ttft = [], [], [], []
    for k in range(rounds):
        order = (False, True) if k % 2 == 0 else (True, False)
        got = {}
        for caching in order:
            if caching not in modes:
                continue
            got[caching] = run(model, tokenizer, replace(config, prefix_caching=caching), items)
            print(json.dumps({**common, "workload": name, "round": k, **got[caching]}),
                  flush=True)
        if len(got) == 2:  # both ran (not --caching on / off): the on / off ratios
            throughput.append(ratio(got[True], got[False], "useful_out_tok_s"))
            ttft.append(ratio(got[True], got[False], "ttft_p50_s"))
        if peer is not None and True in got:
            other = peer()
            print(json.dumps({"workload": name, "round": k, **other}), flush=True)
            assert other["fingerprint"] == fingerprint(items), "vLLM ran other requests"
            peer_throughput.append(ratio(got[True], other, "useful_out_tok_s"))
            peer_ttft.append(ratio(got[True], other, "ttft_p50_s"))
    result = {}
    if throughput:
        result = {"throughput_ratio": round(statistics.median(throughput), 3),
                  "ttft_p50_ratio": round(statistics.median(ttft), 3)}
    if peer_throughput:
        result["vs_vllm_throughput_ratio"] = round(statistics.median(peer_throughput), 3)
        result["vs_vllm_ttft_p50_ratio"] = round(statistics.median(peer_ttft), 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-min", type=int, default=16)
    parser.add_argument("--suffix-max", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--v1-requests", type=int, default=64, help="0: no workload v1 run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kv-cache-gb", type=float, default=2.0)
    parser.add_argument("--max-batched-tokens", type=int,
                        default=EngineConfig.max_batched_tokens, help="prefill tokens per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--caching", choices=("both", "on", "off"), default="both",
                        help="run cache on and off (ratios), or only one of them")
    parser.add_argument("--vllm-model-dir", help="a Hugging Face folder: also run vLLM CPU")
    parser.add_argument("--vllm-python", default="/tmp/peers/vllm-venv/bin/python",
                        help="the python of vLLM's own venv")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    dtype = resolve_dtype(args.dtype, "cpu")
    model = load_model(path, dtype=dtype)
    tokenizer = Tokenizer.load(path)
    config = EngineConfig(kv_cache_gb=args.kv_cache_gb, max_batched_tokens=args.max_batched_tokens)
    dtype_name = str(dtype).removeprefix("torch.")
    common = {"dtype": dtype_name, "threads": args.threads,
              "max_batched_tokens": args.max_batched_tokens, **machine_info()}
    vocab = int(model.embed_tokens.weight.shape[0])
    shared = shared_prefix_workload(args.seed, vocab, args.requests, args.prefix_len,
                                    (args.suffix_min, args.suffix_max), args.output_len)
    peer = vllm_peer(args, dtype_name, vocab) if args.vllm_model_dir else None
    modes = {"both": (False, True), "on": (True,), "off": (False,)}[args.caching]
    summary: dict[str, object] = {
        "benchmark": "prefix_cache", **common,
        "shared_prefix": {"requests": args.requests, "prefix_len": args.prefix_len,
                          "suffix": [args.suffix_min, args.suffix_max],
                          "output_len": args.output_len, "fingerprint": fingerprint(shared),
                          **compare("shared_prefix", model, tokenizer, config, shared,
                                    args.rounds, common, modes, peer)}}
    if args.v1_requests:
        v1 = standard_workload(seed=0, vocab_size=vocab)[:args.v1_requests]
        summary["workload_v1"] = {"requests": len(v1), "fingerprint": fingerprint(v1),
                                  **compare("v1", model, tokenizer, config, v1, args.rounds,
                                            common, modes)}
    if peer is None:
        summary["vllm"] = "not run: pass --vllm-model-dir"
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
