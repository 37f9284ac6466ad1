"""Tool calling's cost: chat jobs that must call a tool (tool_choice required, arguments under
their functions' schemas) beside the same prompts unconstrained, of the same lengths.

    .venv/bin/python -m benchmarks.tools [--jobs 32] [--max-tokens 64] [--rounds 2]

Each round runs, in one process and engine, `--jobs` chats rendered with three tools (the
default model has no tools section: the generic fallback) under tool_choice `required`, then the
same prompts without tools' constraint, each with `min_tokens = max_tokens` set to the length its
constrained run had (`ignore_eos`), so both runs generate the same tokens' count. Time counts from
the first `add` (grammars compile there) to the last token. Prints one JSON line per round and a
summary: tool-call requests per second, output tokens/s of each run, their ratio (target >=
0.95), and the share of calls that parse and validate against their function's schema (100%).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import jsonschema
import torch

from benchmarks.machine import machine_info
from benchmarks.structured import run
from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.request import Prompt, Request, SamplingParams, ToolCalling
from qworker.model.decoder import load_model
from qworker.model.dtypes import resolve_dtype
from qworker.model.loading.hub import resolve_model
from qworker.model.tokenizer.tokenizer import Tokenizer

FUNCTIONS: list[dict[str, Any]] = [
    {"name": "get_weather", "description": "The weather of a city for some days",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string", "maxLength": 24},
         "days": {"type": "integer", "minimum": 1, "maximum": 7},
         "unit": {"enum": ["celsius", "fahrenheit"]}},
         "required": ["city", "days", "unit"], "additionalProperties": False}},
    {"name": "book_meeting", "description": "Book a meeting",
     "parameters": {"type": "object", "properties": {
         "title": {"type": "string", "maxLength": 32},
         "attendees": {"type": "array", "items": {"type": "string", "maxLength": 16},
                       "minItems": 1, "maxItems": 3},
         "hour": {"type": "integer", "minimum": 8, "maximum": 18}},
         "required": ["title", "attendees", "hour"], "additionalProperties": False}},
    {"name": "search", "description": "Search the web",
     "parameters": {"type": "object", "properties": {"query": {"type": "string",
                                                               "maxLength": 40}},
                    "required": ["query"], "additionalProperties": False}},
]
ASKS = ["What will the weather be in Oslo this week?", "Book a design review with Ana at 3pm.",
        "Find the population of Lyon.", "Is it going to rain in Lima tomorrow?"]


def prompts(engine: Engine, n: int) -> list[list[int]]:
    tools = tuple({"type": "function", "function": f} for f in FUNCTIONS)
    return [engine.encode(Prompt(messages=({"role": "user", "content": f"#{i}: "
                                            f"{ASKS[i % len(ASKS)]}"},), tools=tools))
            for i in range(n)]


def valid_calls(engine: Engine, ids: list[list[int]], max_tokens: int) -> tuple[int, int, int]:
    """Calls made, calls valid, and jobs cut at max_tokens inside their call (not counted), from
    one more constrained run."""
    schemas = {f["name"]: f["parameters"] for f in FUNCTIONS}
    made = valid = cut = 0
    tools = ToolCalling(tuple(FUNCTIONS), "required", parallel=False)
    for i, prompt in enumerate(ids):
        engine.add(Request(f"v{i}", prompt, SamplingParams(max_tokens=max_tokens,
                                                           temperature=0.0), tools=tools))
    while engine.has_unfinished():
        for out in engine.step():
            if out.finish_reason == "length":
                cut += 1
                continue
            for call in out.tool_calls or ():
                made += 1
                try:
                    jsonschema.validate(json.loads(call["function"]["arguments"]),
                                        schemas[call["function"]["name"]])
                    valid += 1
                except (ValueError, KeyError, jsonschema.ValidationError):
                    pass
    return made, valid, cut


def round_once(engine: Engine, ids: list[list[int]], max_tokens: int) -> dict[str, Any]:
    tools = ToolCalling(tuple(FUNCTIONS), "required", parallel=False)
    wall_c, tokens_c = run_tools(engine, ids, max_tokens, tools)
    lengths = [len(t) for t in tokens_c.values()]
    plain = [SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)
             for n in lengths]
    wall_u, _, _ = run(engine, ids, plain, "u")
    made, valid, cut = valid_calls(engine, ids, max_tokens)
    out = sum(lengths)
    return {"jobs": len(ids), "output_tokens_each_run": out,
            "tool_call_requests_s": round(len(ids) / wall_c, 2),
            "constrained_tok_s": round(out / wall_c, 1),
            "unconstrained_tok_s": round(out / wall_u, 1), "ratio": round(wall_u / wall_c, 3),
            "calls": made, "valid_calls": valid, "cut_at_max_tokens": cut,
            "valid_share": round(valid / made, 3) if made else None}


def run_tools(engine: Engine, ids: list[list[int]], max_tokens: int, tools: ToolCalling
              ) -> tuple[float, dict[str, list[int]]]:
    """As `benchmarks.structured.run`, each request with the tools."""
    tokens: dict[str, list[int]] = {f"c{i}": [] for i in range(len(ids))}
    started = time.perf_counter()
    for rid, prompt in zip(tokens, ids, strict=True):
        engine.add(Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                           tools=tools))
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id] += out.new_token_ids
    return time.perf_counter() - started, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--jobs", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    config = EngineConfig(max_num_seqs=args.jobs, kv_cache_gb=2.0, prefix_caching=False)
    engine = Engine(load_model(path, dtype=resolve_dtype(args.dtype, "cpu")),
                    Tokenizer.load(path), config)
    engine.warm_up()
    ids = prompts(engine, args.jobs)
    valid_calls(engine, ids[:1], 8)  # first-call costs and the grammar library's tokenizer
    common = {"benchmark": "tools", "model": args.model, "dtype": args.dtype,
              "threads": args.threads, "max_tokens": args.max_tokens}
    rounds = []
    for k in range(args.rounds):
        rounds.append(round_once(engine, ids, args.max_tokens))
        print(json.dumps({**common, "round": k, **rounds[-1]}), flush=True)
    print(json.dumps({**common, "summary": True, "median_ratio": round(statistics.median(
        r["ratio"] for r in rounds), 3), "target_ratio": 0.95,
        "all_valid": all(r["valid_calls"] == r["calls"] for r in rounds),
        **machine_info()}), flush=True)


if __name__ == "__main__":
    main()
