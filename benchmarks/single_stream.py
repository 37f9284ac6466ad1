"""Single stream: one request, a 64-token prompt, 128 new tokens; milliseconds per output token.

    .venv/bin/python -m benchmarks.single_stream [--dtype bfloat16] [--runs 5]
        [--weights dense|quantized] [--llama-bench PATH --gguf MODEL.gguf]
        [--workload random|copy|chat] [--speculate K]
        [--llama-server PATH --gguf MODEL.gguf [--llama-spec-type ngram-simple]]

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

`--workload copy`: chat prompts whose answers copy long spans of the prompt (a code edit, an
extraction, JSON returned unchanged); `--workload chat`: plain questions; both greedy, each run
going through every prompt of the workload one at a time, up to `--new-tokens` each (EOS ends one
sooner). The default, `random`, is the fixed shape above. `--speculate K` adds a third mode to the
alternation, speculative decoding with drafts of up to K tokens (the decode graph on for the steps
without a draft), and prints its ms per token, its speed-up over the decode graph alone and its
acceptance figures. `--llama-server`: llama.cpp's server on `--gguf` (benchmarks/llama_server.py)
runs the same prompts' token ids between our runs, twice: plainly and with its n-gram speculative
decoding (`--spec-type`, `--llama-spec-type`); its ms per token are its own timings' generation
time over its decode forwards, as ours are.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import time
from contextlib import ExitStack
from dataclasses import dataclass

import torch

from benchmarks.llama_server import LlamaRun, llama_server, timed_pass
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


COPY_PROMPTS = (
    "Repeat this code exactly, changing only the function's name to `total_price`:\n\n"
    "def compute(items, tax_rate):\n    subtotal = 0.0\n    for item in items:\n"
    "        subtotal += item.price * item.quantity\n    tax = subtotal * tax_rate\n"
    "    return round(subtotal + tax, 2)\n",
    "Copy the sentence of this text that says where the meeting is, word for word.\n\n"
    "The quarterly review starts at nine. The meeting is in room 4B on the second floor of the "
    "north building, next to the library. Coffee will be served before it starts.",
    'Return this JSON exactly as it is: {"id": 7, "name": "Ada Lovelace", "born": 1815, '
    '"fields": ["mathematics", "computing"], "city": "London"}',
    "Rewrite this list in the same order, each item on its own line with a dash in front: "
    "apples, bread, milk, eggs, butter, cheese, tomatoes, rice, coffee.",
)
CHAT_PROMPTS = (
    "What is the capital of France, and what is it known for?",
    "Give me three tips for sleeping better.",
    "Explain what a hash table is in a few sentences.",
    "Write a short poem about autumn.",
)


@dataclass(frozen=True)
class Mode:
    graph: bool  # the decode graph on for decode steps
    speculate: bool


def one_run(engine: Engine, prompts: list[list[int]], run: int, mode: Mode, new_tokens: int,
            fixed_length: bool) -> tuple[float, float]:
    """(median time to first token, mean seconds per later token) over the prompts in turn;
    `fixed_length`: each answer exactly `new_tokens` long (EOS ignored)."""
    engine.runner.model.decode_graph.enabled = mode.graph
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, speculate=mode.speculate,
                            **(dict(min_tokens=new_tokens, ignore_eos=True) if fixed_length
                               else {}))
    firsts, decode_seconds, later_tokens = [], 0.0, 0
    for i, prompt in enumerate(prompts):
        engine.add(Request(f"single-{run}-{i}-{mode}", prompt, params))
        started = time.perf_counter()
        stamps: list[tuple[float, int]] = []  # (when, tokens that step gave)
        while engine.has_unfinished():
            count = sum(len(o.new_token_ids) for o in engine.step())
            if count:
                stamps.append((time.perf_counter(), count))
        tokens = sum(count for _, count in stamps)
        assert not fixed_length or tokens == new_tokens
        firsts.append(stamps[0][0] - started)
        decode_seconds += stamps[-1][0] - stamps[0][0]
        later_tokens += tokens - stamps[0][1]
    return statistics.median(firsts), decode_seconds / max(1, later_tokens)


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
    parser.add_argument("--workload", default="random", choices=("random", "copy", "chat"),
                        help="random: one 64-token prompt of random ids, 128 tokens; copy: "
                             "answers that copy spans of their prompts; chat: plain questions")
    parser.add_argument("--speculate", type=int, default=0, metavar="K",
                        help="also run with speculative decoding, drafts of up to K tokens")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS,
                        help="copy / chat: the most tokens of each answer")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary, to run beside")
    parser.add_argument("--llama-spec-type", default="ngram-simple",
                        help="the llama-server's --spec-type for its speculative runs")
    args = parser.parse_args()
    if (args.llama_bench or args.llama_server) and not args.gguf:
        parser.error("--llama-bench and --llama-server need --gguf")
    torch.set_num_threads(args.threads)
    path = str(resolve_model(args.model))
    model = load_model(path, dtype=resolve_dtype(args.dtype, "cpu"), weights=args.weights)
    tokenizer = Tokenizer.load(path)
    engine = Engine(model, tokenizer, EngineConfig(
        max_num_seqs=1, kv_cache_gb=0.25, prefix_caching=False,
        num_speculative_tokens=args.speculate))
    engine.prepare()  # as Engine.from_config does
    fixed = args.workload == "random"
    new_tokens = NEW_TOKENS if fixed else args.new_tokens
    if fixed:
        rng = random.Random(0)
        prompts = [[rng.randrange(32, model.config.vocab_size) for _ in range(PROMPT_TOKENS)]]
    else:
        texts = COPY_PROMPTS if args.workload == "copy" else CHAT_PROMPTS
        prompts = [tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
    plain, layers, speculative = Mode(True, False), Mode(False, False), Mode(True, True)
    modes = [plain, layers] + ([speculative] if args.speculate else [])
    runs: dict[Mode, list[tuple[float, float]]] = {mode: [] for mode in modes}
    llama_ms = []
    servers: dict[str, str] = {}
    server_runs: dict[str, list[LlamaRun]] = {"plain": [], "spec": []}
    with ExitStack() as stack:
        if args.llama_server:
            for name, extra in (("plain", ()), ("spec", ("--spec-type", args.llama_spec_type))):
                servers[name] = stack.enter_context(
                    llama_server(args.llama_server, args.gguf, args.threads, extra))
        for i in range(args.runs):  # interleaved, so that a noisy spell hits every engine alike
            for mode in modes:
                runs[mode].append(one_run(engine, prompts, i, mode, new_tokens, fixed))
            if args.llama_bench:
                llama_ms.append(llama_bench_ms_per_token(args.llama_bench, args.gguf,
                                                         args.threads))
            for name, url in servers.items():
                server_runs[name].append(timed_pass(url, prompts, new_tokens, fixed))
    ms = {mode: statistics.median(r[1] for r in runs[mode]) * 1000 for mode in runs}
    figures = {
        "dtype": args.dtype, "weights": model.weights_kept(),
        "weight_mb": round(model.weight_bytes() / 2**20, 1), "threads": args.threads,
        "workload": args.workload, "prompts": len(prompts),
        "prompt_tokens": round(statistics.mean(len(p) for p in prompts)),
        "new_tokens": new_tokens, "runs": args.runs, **machine_info(),
        "kernels": model.kernel_report(), "ms_per_token": round(ms[plain], 2),
        "layer_by_layer_ms_per_token": round(ms[layers], 2),
        "ttft_ms": round(statistics.median(r[0] for r in runs[plain]) * 1000, 1),
        "bare_matmul_ms_per_token": round(bare_matmul_seconds(model) * 1000, 2),
    }
    if engine.speculator is not None:
        drafted, accepted = engine.speculator.drafted, engine.speculator.accepted
        figures |= {"speculate_tokens": args.speculate,
                    "speculate_ms_per_token": round(ms[speculative], 2),
                    "speculate_speedup": round(ms[plain] / ms[speculative], 3),
                    "spec_drafted": drafted, "spec_accepted": accepted,
                    "spec_acceptance_rate": round(accepted / drafted, 3) if drafted else None}
    if llama_ms:
        figures |= {"llama_cpp_ms_per_token": round(statistics.median(llama_ms), 2),
                    "llama_cpp_over_ours": round(statistics.median(llama_ms) / ms[plain], 3)}
    if servers:
        figures |= server_figures(server_runs, args.llama_spec_type, ms[plain],
                                  ms[speculative] if args.speculate else None)
    print(json.dumps(figures), flush=True)


def server_figures(server_runs: dict[str, list[LlamaRun]], spec_type: str, ours_ms: float,
                   ours_spec_ms: float | None) -> dict[str, object]:
    """The llama-server's medians beside ours: plain against our plain decode, speculative
    against our speculative decoding (the time per token, ours over theirs)."""
    plain = statistics.median(r.ms_per_token for r in server_runs["plain"])
    spec = statistics.median(r.ms_per_token for r in server_runs["spec"])
    drafted = sum(r.drafted for r in server_runs["spec"])
    accepted = sum(r.accepted for r in server_runs["spec"])
    figures: dict[str, object] = {
        "llama_server_ms_per_token": round(plain, 2),
        "llama_server_spec_type": spec_type,
        "llama_server_spec_ms_per_token": round(spec, 2),
        "llama_server_spec_speedup": round(plain / spec, 3),
        "llama_server_spec_acceptance_rate": round(accepted / drafted, 3) if drafted else None,
        "ours_over_llama_server_time": round(ours_ms / plain, 3)}
    if ours_spec_ms is not None:
        figures["ours_spec_over_llama_server_spec_time"] = round(ours_spec_ms / spec, 3)
    return figures


def llama_bench_ms_per_token(binary: str, gguf: str, threads: int) -> float:
    """ms per generated token of llama.cpp on the same shape (one run)."""
    command = [binary, "-m", gguf, "-t", str(threads), "-p", "0", "-n", str(NEW_TOKENS),
               "-d", str(PROMPT_TOKENS), "-r", "1", "-o", "json"]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    [result] = json.loads(out)
    return 1000 / statistics.median(result["samples_ts"])


if __name__ == "__main__":
    main()
