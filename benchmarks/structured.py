"""Structured output's cost: jobs under a JSON Schema beside unconstrained jobs of the same lengths.

    .venv/bin/python -m benchmarks.structured [--jobs 64] [--max-tokens 96] [--rounds 2]

Each round runs, in the same process and engine, `--jobs` extraction prompts constrained by a
JSON Schema (nested objects, enums, arrays, string patterns; greedy), then the same prompts
unconstrained with each job's `min_tokens = max_tokens` set to the length its constrained run
had (`ignore_eos`), so both runs generate exactly the same number of tokens. Time counts from
the first `add` (the constrained jobs compile their grammar there) to the last token. Prints one
JSON line per round and a summary: output tokens/s of each, their ratio (target >= 0.9), the
median ratio over rounds, the time the step waited for masks after the forward (and the mask
thread's own time), each run's time outside the forward with the ratio it gives at equal forward
time (less exposed to a busy machine's noise), and whether every constrained output parses and
validates against the schema (`jsonschema`).
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
from qworker.engine import structured
from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.request import Request, SamplingParams, StructuredOutputs
from qworker.model.decoder import load_model
from qworker.model.dtypes import resolve_dtype
from qworker.model.loading.hub import resolve_model
from qworker.model.tokenizer.tokenizer import Tokenizer

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}( [A-Z][a-z]{1,12})?$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "teacher", "doctor", "artist", "other"]},
        "contact": {
            "type": "object",
            "properties": {
                "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,10}\\.(com|org)$"},
                "city": {"type": "string", "maxLength": 24},
            },
            "required": ["email", "city"], "additionalProperties": False,
        },
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16},
                   "minItems": 1, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "contact", "skills", "active"],
    "additionalProperties": False,
}
PEOPLE = ["Ada, a 36 year old engineer from London", "Marco, a teacher in Rome aged 51",
          "Yuki, 29, an artist living in Osaka", "Sam Hill, a doctor (44) in Boston",
          "Lena, a 23 year old student in Berlin", "Omar, a retired engineer, 70, in Cairo",
          "Priya, 31, a doctor in Pune", "Tom, an artist in Dublin, 58"]


class MaskWait:
    """Time the step spends in MaskFuture.result() (masks not ready when the forward ended), and
    the time the mask thread spent computing them (overlapped with the forward)."""

    def __init__(self) -> None:
        self.seconds = self.computing = 0.0
        original = structured.MaskFuture.result
        compute = structured.mask_biases

        def computed(matchers: Any) -> Any:
            started = time.perf_counter()
            try:
                return compute(matchers)
            finally:
                self.computing += time.perf_counter() - started

        structured.mask_biases = computed  # MaskFuture looks it up when it submits

        def timed(future: structured.MaskFuture) -> Any:
            started = time.perf_counter()
            try:
                return original(future)
            finally:
                self.seconds += time.perf_counter() - started

        structured.MaskFuture.result = timed  # type: ignore[method-assign,assignment]


def prompts(tokenizer: Tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.encode_chat([{"role": "user", "content": (
        f"Record #{i}: {PEOPLE[i % len(PEOPLE)]}. Write this person as a JSON object with "
        "name, age, role, contact (email, city), skills and active.")}]) for i in range(n)]


def run(engine: Engine, ids: list[list[int]], params: list[SamplingParams], tag: str
        ) -> tuple[float, dict[str, list[int]], dict[str, str]]:
    tokens: dict[str, list[int]] = {f"{tag}{i}": [] for i in range(len(ids))}
    texts: dict[str, str] = {}
    started = time.perf_counter()
    for (rid, prompt), p in zip(zip(tokens, ids, strict=True), params, strict=True):
        engine.add(Request(rid, prompt, p))
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                assert out.error is None, out.error
                texts[out.request_id] = out.text or ""
    return time.perf_counter() - started, tokens, texts


def round_once(engine: Engine, ids: list[list[int]], max_tokens: int, waits: MaskWait
               ) -> dict[str, Any]:
    so = StructuredOutputs(json=json.dumps(SCHEMA))
    constrained = [SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=so)
                   for _ in ids]
    waits.seconds = waits.computing = engine.runner.forward_seconds = 0.0
    wall_c, tokens_c, texts = run(engine, ids, constrained, "c")
    waited, computing, forward_c = waits.seconds, waits.computing, engine.runner.forward_seconds
    lengths = [len(t) for t in tokens_c.values()]
    plain = [SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)
             for n in lengths]
    engine.runner.forward_seconds = 0.0
    wall_u, tokens_u, _ = run(engine, ids, plain, "u")
    forward_u = engine.runner.forward_seconds
    assert [len(t) for t in tokens_u.values()] == lengths, "unequal lengths"
    valid = 0
    for text in texts.values():
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    out = sum(lengths)
    return {"jobs": len(ids), "output_tokens_each_run": out,
            "constrained_tok_s": round(out / wall_c, 1),
            "unconstrained_tok_s": round(out / wall_u, 1),
            "ratio": round(wall_u / wall_c, 3), "mask_wait_s": round(waited, 3),
            "mask_compute_s": round(computing, 3),
            # time outside the model's forward (scheduling, sampling, masks applied, matchers
            # advanced, grammars compiled): the part structured output adds to, and less
            # exposed to a busy neighbour's noise than the forward
            "outside_forward_s": {"constrained": round(wall_c - forward_c, 2),
                                  "unconstrained": round(wall_u - forward_u, 2)},
            "ratio_at_equal_forward": round(wall_u / (forward_u + wall_c - forward_c), 3),
            "constrained_wall_s": round(wall_c, 2), "unconstrained_wall_s": round(wall_u, 2),
            "valid": valid, "all_valid": valid == len(ids),
            "mean_len": round(out / len(ids), 1), "example": next(iter(texts.values()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--kv-cache-gb", type=float, default=2.0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    tokenizer = Tokenizer.load(path)
    config = EngineConfig(max_num_seqs=args.jobs, kv_cache_gb=args.kv_cache_gb,
                          prefix_caching=False)
    engine = Engine(load_model(path, dtype=resolve_dtype(args.dtype, "cpu")), tokenizer, config)
    engine.warm_up()
    ids = prompts(tokenizer, args.jobs)
    engine.generate([ids[0]], SamplingParams(max_tokens=4, ignore_eos=True))  # first-call costs
    engine.grammars.matcher(StructuredOutputs(json_object=True))  # the library's tokenizer, once
    waits = MaskWait()
    common = {"benchmark": "structured", "model": args.model, "dtype": args.dtype,
              "threads": args.threads, "max_tokens": args.max_tokens, "library": "llguidance"}
    rounds = []
    for k in range(args.rounds):
        result = round_once(engine, ids, args.max_tokens, waits)
        rounds.append(result)
        print(json.dumps({**common, "round": k, **result}), flush=True)
    print(json.dumps({**common, "summary": True, "median_ratio": round(statistics.median(
        r["ratio"] for r in rounds), 3), "target_ratio": 0.9,
        "all_valid": all(r["all_valid"] for r in rounds), **machine_info()}), flush=True)


if __name__ == "__main__":
    main()
