"""`qworker generate PROMPT`: run the model offline and stream its completion to stdout."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("generate", help="complete one prompt offline (no Redis)")
    parser.add_argument("prompt", help="the user message (or raw text with --raw)")
    parser.add_argument("--model", default="smollm2", help="model name, HF folder or .gguf file")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--raw", action="store_true", help="no chat template: complete the text")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from qworker.engine.config import EngineConfig
    from qworker.engine.engine import Engine
    from qworker.engine.request import Request, SamplingParams

    engine = Engine.from_config(EngineConfig(model=args.model, dtype=args.dtype,
                                             device=args.device, max_num_seqs=1,
                                             kv_cache_gb=0.25))
    tokenizer = engine.tokenizer
    prompt = (tokenizer.encode(args.prompt) if args.raw
              else tokenizer.encode_chat([{"role": "user", "content": args.prompt}]))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    engine.add(Request("generate", prompt, params))
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.text_delta)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
