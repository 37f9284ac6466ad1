"""What a command reports in one line and exits 2 for, without a traceback: a model it was given
that cannot run (no such name or path, an unreadable or malformed checkpoint, an architecture or
feature not supported, a tokenizer that cannot be built). Each room's error derives from it."""

from __future__ import annotations


class ModelInputError(Exception):
    """The model named cannot be loaded or run; the message names the file and the problem."""


def one_line(exc: BaseException) -> str:
    """The message on one line (a library's message may span several)."""
    return " ".join(str(exc).split())
