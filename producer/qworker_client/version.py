"""`qworker --version`: the client's version and the worker's where it is installed, from the
package metadata (the worker's distribution is the one that registers the worker's commands)."""

from __future__ import annotations

import argparse
from importlib import metadata
from typing import Any, NoReturn

CLIENT_DISTRIBUTION = "qworker-client"
WORKER_ENTRY_POINTS = "qworker.commands"  # as in commands/worker.py


def version_text() -> str:
    try:
        client = metadata.version(CLIENT_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        client = "(not installed: run from a source tree)"
    workers = sorted({(ep.dist.name, ep.dist.version)
                      for ep in metadata.entry_points(group=WORKER_ENTRY_POINTS) if ep.dist})
    shown = ", ".join(f"{name} {version}" for name, version in workers)
    return f"{CLIENT_DISTRIBUTION} {client}; worker: {shown or 'not installed'}"


class VersionAction(argparse.Action):
    """`--version`: prints `version_text()` (read only when asked) and exits."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the client's and the worker's versions and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> NoReturn:
        print(version_text())  # on stdout, as argparse's own version action
        parser.exit()


def add_version_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action=VersionAction)
