"""`qworker` command line: dispatches to one module per sub-command in `qworker.commands`."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = (
    "qworker.commands.model",
    "qworker.commands.generate",
    "qworker.commands.submit",
    "qworker.commands.tail",
    "qworker.commands.stats",
    "qworker.commands.serve",
    "qworker.commands.up",
    "qworker.commands.demo",
    "qworker.commands.batch",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qworker", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
