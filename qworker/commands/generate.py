"""`qworker generate PROMPT`: run the model offline and stream its completion to stdout.

By default it samples as a job does, with a job's defaults (so runs differ unless given --seed);
--temperature 0 is greedy. `--model sim` runs the simulated engine (no torch).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from qworker.commands.config_flags import add_config_flags
from qworker.engine.config import EngineConfig
from qworker.engine.request import Request, SamplingParams

SAMPLING_HELP = {
    "max_tokens": {"help": "tokens to generate at most"},
    "temperature": {"help": "as a job's: 0 is greedy (--temperature 0), higher is more random"},
    "top_p": {"help": "nucleus sampling: the smallest set of tokens this likely"},
    "top_k": {"help": "only the k likeliest tokens (0: off)"},
    "seed": {"help": "a seeded run is reproducible"},
}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("generate", help="complete one prompt offline (no Redis)",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", help="the user message (or raw text with --raw)")
    add_config_flags(parser, EngineConfig, env=False, only=("model", "dtype", "weights", "device"),
                     model={"help": "model name, HF folder or .gguf file; sim: the simulated "
                                    "engine"})
    add_config_flags(parser, SamplingParams, env=False, only=tuple(SAMPLING_HELP),
                     **SAMPLING_HELP)
    parser.add_argument("--raw", action="store_true", help="no chat template: complete the text")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from qworker.commands.config_flags import config_values
    from qworker.commands.serve import engine_for
    from qworker.model.errors import ModelInputError, one_line

    try:
        engine = engine_for(EngineConfig(**config_values(args, EngineConfig), max_num_seqs=1,
                                         kv_cache_gb=0.25))
        tokenizer = engine.tokenizer
        prompt = (tokenizer.encode(args.prompt) if args.raw
                  else tokenizer.encode_chat([{"role": "user", "content": args.prompt}]))
    except ModelInputError as exc:  # a bad model: one line, no traceback
        print(f"qworker generate: {one_line(exc)}", file=sys.stderr)
        return 2
    params = SamplingParams(**config_values(args, SamplingParams))
    engine.add(Request("generate", prompt, params))
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.text_delta)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
