"""The worker's sub-commands (`serve`, `up`, `generate`, `model`, `demo`), found through the
`qworker.commands` entry-point group that the `qworker-llm` distribution registers, so this
package never imports `qworker` by name. Where the worker (or a dependency of its extra) is
missing, such a command says in one line what to install and exits 2, with no traceback."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

from qworker_client.cli import EXIT_USAGE, report_error

ENTRY_POINT_GROUP = "qworker.commands"
WORKER_COMMANDS = ("model", "generate", "serve", "up", "demo")
INSTALL_HINT = "pip install 'qworker-llm[worker]'"
Run = Callable[[argparse.Namespace], int]


def register_worker_commands(subparsers: argparse._SubParsersAction) -> None:
    found = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    extra = sorted(set(found) - set(WORKER_COMMANDS))
    for name in (*WORKER_COMMANDS, *extra):
        _register_one(subparsers, name, found.get(name))


def _register_one(
    subparsers: argparse._SubParsersAction, name: str, entry: EntryPoint | None
) -> None:
    if entry is None:
        _register_missing(subparsers, name, "not installed")
        return
    try:
        register = entry.load()
    except ImportError as exc:
        _register_missing(subparsers, name, f"{exc.name or exc} is missing")
        return
    register(subparsers)
    parser = subparsers.choices[name]
    parser.set_defaults(func=_hints_missing_modules(name, parser.get_default("func")))


def _register_missing(subparsers: argparse._SubParsersAction, name: str, reason: str) -> None:
    """A stand-in that takes any arguments (even `--help`: see `cli.main`) and prints the hint."""
    parser = subparsers.add_parser(name, add_help=False, help=f"needs the worker: {INSTALL_HINT}")
    parser.set_defaults(func=lambda _args: not_installed(name, reason), takes_any_arguments=True)


def _hints_missing_modules(name: str, run: Run) -> Run:
    """`run`, with a third-party module missing at run time (torch without the worker extra)
    reported as the install hint instead of a traceback."""

    @functools.wraps(run)
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except ModuleNotFoundError as exc:
            if (exc.name or "qworker").split(".")[0] in ("qworker", "qworker_client"):
                raise  # our own module missing is a bug, not an install to suggest
            return not_installed(name, f"{exc.name} is missing")

    return wrapper


def not_installed(name: str, reason: str) -> int:
    report_error(f"`{name}` needs the worker ({reason}): {INSTALL_HINT}")
    return EXIT_USAGE
