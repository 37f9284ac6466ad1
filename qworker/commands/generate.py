"""`qworker generate PROMPT`: run the model offline and stream its completion to stdout.

The prompt is a user message in the model's chat template (a model without one: the text as
is; `--raw` for a plain completion). Sampling left unset is the model's default (its
generation_config.json or GGUF metadata, else the documented one: docs/protocol.md, "Sampling
defaults"); runs differ unless given --seed; --temperature 0 is greedy. Only the answer goes to
stdout (logs and progress to stderr), so `generate ... > answer.txt` holds the answer alone.
`--model sim` runs the simulated engine (no torch).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from qworker.commands.config_flags import add_config_flags
from qworker.engine.config import EngineConfig
from qworker.engine.request import Request, SamplingParams

_MODEL_DEFAULT = "default: the model's"
SAMPLING_HELP: dict[str, dict[str, Any]] = {
    "max_tokens": {"help": "tokens to generate at most"},
    "temperature": {"help": f"0 is greedy (--temperature 0), higher is more random "
                            f"({_MODEL_DEFAULT}, else 1.0)", "default": None},
    "top_p": {"help": f"nucleus sampling: the smallest set of tokens this likely "
                      f"({_MODEL_DEFAULT}, else 1.0)", "default": None},
    "top_k": {"help": f"only the k likeliest tokens, 0: off ({_MODEL_DEFAULT}, else 0)",
              "default": None},
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
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--raw", action="store_true", help="no chat template: complete the text")
    kind.add_argument("--chat", action="store_true",
                      help="the chat template, required (the default where the model has one)")
    parser.add_argument("--log-level", default="warning",
                        choices=("debug", "info", "warning", "error"),
                        help="what to log on stderr (default warning)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        return _generate(args)
    except KeyboardInterrupt:  # Ctrl-C while it loads or writes: the line ended, no traceback
        sys.stdout.write("\n")
        return 130


def _generate(args: argparse.Namespace) -> int:
    from qworker.commands.config_flags import config_values
    from qworker.commands.serve import engine_for
    from qworker.engine.request import sampling_params
    from qworker.model.errors import ModelInputError, one_line
    from qworker.model.loading.hub import resolve_model
    from qworker.model.tokenizer.tokenizer import Tokenizer
    from qworker.service.logs import configure_logging, get_logger

    configure_logging(args.log_level)  # on stderr: stdout is the answer's
    try:
        if args.chat:  # a chat asked of a base model is said before its weights load
            prompt_ids(Tokenizer.load(resolve_model(args.model)), args)
        engine = engine_for(EngineConfig(**config_values(args, EngineConfig), max_num_seqs=1,
                                         kv_cache_gb=0.25))
        prompt = prompt_ids(engine.tokenizer, args)
    except ModelInputError as exc:  # a bad model: one line, no traceback
        print(f"qworker generate: {one_line(exc)}", file=sys.stderr)
        return 2
    params = sampling_params(config_values(args, SamplingParams), engine.sampling_defaults)
    get_logger().info("generating", model=args.model, prompt_tokens=len(prompt),
                      temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                      model_defaults=engine.sampling_defaults)
    engine.add(Request("generate", prompt, params))
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.text_delta)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def prompt_ids(tokenizer: Any, args: argparse.Namespace) -> list[int]:
    """The prompt as a user message in the chat template, or as is (--raw, or a model without a
    template unless --chat insists)."""
    if args.raw or not (args.chat or tokenizer.has_chat_template):
        return list(tokenizer.encode(args.prompt))
    return list(tokenizer.encode_chat([{"role": "user", "content": args.prompt}]))
