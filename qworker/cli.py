"""`qworker` from the worker's side: the client's command line (`qworker_client.cli`), which finds
this distribution's sub-commands through its `qworker.commands` entry points (pyproject.toml)."""

from __future__ import annotations

import sys

from qworker_client.cli import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
