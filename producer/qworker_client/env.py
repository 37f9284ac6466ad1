"""`QWORKER_<FLAG>` variables as the defaults of flags: a value that does not parse as its flag's
type is ignored with one warning line on stderr, never a crash.

Kubernetes gives every pod variables for each Service of its namespace, among them
`<SERVICE>_PORT=tcp://10.0.0.5:8000`: a Service named `qworker` sets `QWORKER_PORT`, which is the
gateway's `--port`. A variable is kept as the flag's default text (`EnvText`); argparse parses it
only for the command that runs and only when the flag is not given, with `lenient(parse, ...)`,
which is `parse` for the command line and falls back to the flag's own default for a variable.
A value of the right type that the flag does not allow (an unknown choice) stays an error, as
it would be on the command line.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
SERVICE_LINK = re.compile(r"^(tcp|udp|sctp)://")  # what Kubernetes' *_PORT variables hold
LINK_NAME = re.compile(r"^(?P<service>\w+?)_PORT(_\d+_(TCP|UDP|SCTP))?$")  # QWORKER_PORT
TYPE_WORDS: dict[Any, str] = {int: "an integer", float: "a number", bool: "a boolean"}
_warned: set[str] = set()


class EnvText(str):
    """A flag's default as the text of the environment variable `name`."""

    name: str

    def __new__(cls, text: str, name: str) -> EnvText:
        made = super().__new__(cls, text)
        made.name = name
        return made


def env_text(name: str) -> EnvText | None:
    """The variable `name` as a flag's default text (None: not set, or empty)."""
    text = os.environ.get(name)
    return None if not text else EnvText(text, name)


def lenient(parse: Callable[[str], T], default: T, what: str | None = None
            ) -> Callable[[str], T]:
    """`parse` as strict as it is for the command line; for a variable's text (`EnvText`) that
    does not parse, a warning and `default`. `what` names the kind of value ("an integer")."""

    def parse_value(text: str) -> T:
        try:
            return parse(text)
        except (ValueError, argparse.ArgumentTypeError):
            if not isinstance(text, EnvText):
                raise
            warn_ignored(text.name, text, what or TYPE_WORDS.get(parse, "a value its flag takes"))
            return default

    parse_value.__name__ = getattr(parse, "__name__", "value")  # argparse: "invalid int value"
    return parse_value


def warn_ignored(name: str, text: str, what: str) -> None:
    """One line on stderr, once per variable: `name` is ignored, its text is not `what`."""
    if name in _warned:
        return
    _warned.add(name)
    link = LINK_NAME.match(name) if SERVICE_LINK.match(text) else None
    hint = (f" (Kubernetes sets it for a Service named {_service(link)!r}: name that Service "
            "otherwise)" if link else "")
    print(f"qworker: warning: ignoring {name}={text!r}: not {what}{hint}", file=sys.stderr,
          flush=True)


def _service(link: re.Match[str]) -> str:
    """The Service whose variable `link` matched (QWORKER_PORT: `qworker`)."""
    return link.group("service").lower().replace("_", "-")
