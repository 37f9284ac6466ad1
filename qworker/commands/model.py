"""`qworker model fetch [NAME]`, `qworker model path NAME` and `qworker model list`: get, locate
or list model files. The path goes to stdout, how far a fetch is to stderr; an unknown name
exits 2, a failed download 3, a model not fetched yet (`path`) 1. `--model` also takes any GGUF
file (a split one by any of its shards' names) or Hugging Face folder by its path."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("model", help="fetch or locate model files")
    commands = parser.add_subparsers(dest="model_command", required=True)

    fetch = commands.add_parser("fetch", help="download a known model (once) and print its path")
    fetch.add_argument("name", nargs="?", default="smollm2", help="model name (default: smollm2)")
    fetch.set_defaults(func=run_fetch)

    path = commands.add_parser("path", help="print where a model is, without fetching it")
    path.add_argument("name", help="model name or path")
    path.set_defaults(func=run_path)

    listing = commands.add_parser("list", help="the known models and the model files cached here")
    listing.set_defaults(func=run_list)


def run_fetch(args: argparse.Namespace) -> int:
    from qworker.model.loading.hub import ModelFetchError, UnknownModelError, resolve_model

    try:
        print(resolve_model(args.name))
    except UnknownModelError as exc:  # what the user typed: a usage error
        print(f"qworker model fetch: {exc}", file=sys.stderr)
        return 2
    except ModelFetchError as exc:  # the download failed: a runtime one
        print(f"qworker model fetch: {' '.join(str(exc).split())}", file=sys.stderr)
        return 3
    return 0


def run_path(args: argparse.Namespace) -> int:
    from qworker.model.loading.hub import UnknownModelError, local_path

    try:
        path = local_path(args.name)
    except UnknownModelError as exc:
        print(f"qworker model path: {exc}", file=sys.stderr)
        return 2
    print(path)
    if not path.exists():
        print(f"not fetched yet; run: qworker model fetch {args.name}", file=sys.stderr)
        return 1
    return 0


def run_list(args: argparse.Namespace) -> int:
    from qworker.model.loading.hub import cached_models

    for name, path in cached_models():
        if path is None:
            print(f"{name}\tnot fetched (qworker model fetch {name})")
        else:
            size = path.stat().st_size if path.is_file() else sum(
                f.stat().st_size for f in path.rglob("*") if f.is_file())
            print(f"{name}\t{size / 1e6:.0f} MB\t{path}")
    return 0
