"""Command-line flags made from the fields of a config dataclass, and the config made from them.

Each field is the flag `--field-name` (metadata `flag` names another, `flag: None` means no flag),
with the field's type and default (a bool field that is True by default is a flag that turns it
off, e.g. `--no-prefix-caching`) and the help of its metadata `help` (and `choices`, if any).
Every flag can also be given as `QWORKER_<FLAG>` (dashes as underscores, upper case); the command
line wins. So a setting is stated once, where its dataclass states it.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from qworker_client.env import env_text, lenient


@dataclasses.dataclass(frozen=True)
class Flag:
    """One config field as a command-line flag."""

    name: str  # "--stall-timeout"
    field: str  # "stall_timeout_s"
    type: Callable[[str], Any]
    default: Any  # None: none of its own (a default_factory, or optional)
    help: str
    choices: tuple[str, ...] | None = None
    required: bool = False

    @property
    def dest(self) -> str:
        """Where argparse keeps its value: a flag that turns a field off keeps the field's."""
        return self.field if self.default is True else dest(self.name)


def dest(flag: str) -> str:
    """The attribute of `flag` in parsed arguments, as argparse names it ("stall_timeout")."""
    return flag.lstrip("-").replace("-", "_")


def env_name(flag: str) -> str:
    return "QWORKER_" + dest(flag).upper()


def flag_name(f: dataclasses.Field[Any]) -> str | None:
    """The flag of a field: `--field-name`, its metadata's `flag`, or None (no flag)."""
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def flags_of(cls: type, only: tuple[str, ...] | None = None,
             **changes: dict[str, Any]) -> Iterator[Flag]:
    """The flags of a config dataclass (of its fields in `only`, if given), in field order.

    `changes` maps a field name to what differs for one command: `required`, `default`, `help`.
    """
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = flag_name(f)
        if name is None or (only is not None and f.name not in only):
            continue
        spec = {"help": None, "choices": None, **f.metadata, **changes.get(f.name, {})}
        if spec["help"] is None:
            raise TypeError(f"{cls.__name__}.{f.name} has no help (field metadata)")
        default = spec.get("default", None if f.default is dataclasses.MISSING else f.default)
        yield Flag(name, f.name, _scalar(hints[f.name]), default, spec["help"], spec["choices"],
                   spec.get("required", False))


def _scalar(hint: Any) -> Callable[[str], Any]:
    """`int` of `int` or `int | None`: what parses the flag's text."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return _scalar(args[0])
    if hint in (str, int, float, bool, Path):
        return typing.cast(Callable[[str], Any], hint)
    raise TypeError(f"no flag for a field of type {hint}")


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r} (1/0, true/false, yes/no)")


def add_flag(parser: argparse.ArgumentParser, flag: Flag, env: bool = True) -> None:
    """`flag` on `parser`; its environment variable, if set and `env`, is its default (one that
    does not parse is ignored with a warning: qworker_client/env.py)."""
    default: Any = flag.default
    required = flag.required
    text = env_text(env_name(flag.name)) if env else None
    if text is not None:
        default, required = text, False
    notes = [f"env {env_name(flag.name)}"] if env else []
    if flag.default is not None:
        notes.append(f"default {flag.default}")
    shown = flag.help + (f" ({'; '.join(notes)})" if notes else "")
    if flag.type is bool:  # a field that is on by default is a flag that turns it off
        on = flag.default is not True
        if isinstance(default, str):  # the variable says what the flag would: set means given
            default = lenient(parse_bool, None, "a boolean")(default)
            default = flag.default if default is None else default == on
        parser.add_argument(flag.name, action="store_true" if on else "store_false", help=shown,
                            default=default, dest=flag.dest)
        return
    kind = lenient(flag.type, flag.default)
    if flag.choices:
        kind = _checked(kind, flag.choices)
    parser.add_argument(flag.name, type=kind, default=default, required=required,
                        choices=flag.choices, help=shown)


def _checked(kind: Callable[[str], Any], choices: tuple[str, ...]) -> Callable[[str], Any]:
    """`kind` that refuses a value outside `choices`: argparse checks no choice of a default,
    and a default from the environment is as much the user's word as a flag."""

    def parse(text: str) -> Any:
        value = kind(text)
        if value not in choices:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {text!r} (choose from {', '.join(map(str, choices))})")
        return value

    return parse


def add_config_flags(parser: argparse.ArgumentParser, cls: type, env: bool = True,
                     only: tuple[str, ...] | None = None, **changes: dict[str, Any]) -> None:
    """The flags of `cls` on `parser` (see `flags_of` for `only` and `changes`)."""
    for flag in flags_of(cls, only, **changes):
        add_flag(parser, flag, env=env)


def config_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of `cls` that `args` holds a flag's value for (None: the dataclass' default)."""
    values = {}
    for f in dataclasses.fields(cls):
        name = flag_name(f)
        key = f.name if f.default is True else dest(name or "")  # True: a flag that turns it off
        value = getattr(args, key, None) if name else None
        if value is not None:
            values[f.name] = value
    return values
